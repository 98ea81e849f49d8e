"""`verispec generate` / `bench`: streaming output, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verispec", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_streams_text(tiny_llama):
    from verispec import LLM, SamplingParams

    r = _run("generate", tiny_llama, "-p", "def add(a, b):", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    want = LLM(tiny_llama).generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=8))[0]
    assert r.stdout == want.outputs[0].text + "\n"


def test_generate_with_speculation_matches_plain(tiny_llama):
    plain = _run("generate", tiny_llama, "-p", "The quick brown fox", "--max-tokens", "12")
    spec = _run(
        "generate",
        tiny_llama,
        "-p",
        "The quick brown fox",
        "--max-tokens",
        "12",
        "--speculative-config",
        json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
    )
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert plain.stdout == spec.stdout


def _bad_inputs(tmp: Path, tiny: str) -> list[tuple[list[str], str]]:
    garbage = tmp / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    truncated = tmp / "trunc.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 8)
    arch = tmp / "arch"
    arch.mkdir()
    (arch / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    no_tok = tmp / "no_tokenizer"
    shutil.copytree(tiny, no_tok)
    (no_tok / "tokenizer.json").unlink()
    ngram_inf = '{"method": "suffix", "suffix_decoding_max_spec_factor": Infinity}'
    return [
        (["generate", "no-such-model", "-p", "x"], "not found"),
        (["generate", str(tmp / "missing.gguf"), "-p", "x"], "not found"),
        (["generate", str(garbage), "-p", "x"], str(garbage)),
        (["generate", str(truncated), "-p", "x"], str(truncated)),
        (["generate", str(arch), "-p", "x"], "unsupported architecture"),
        (["generate", tiny, "-p", "x", "--speculative-config", "{bad json"], "JSON"),
        (["generate", tiny, "-p", "x", "--speculative-config", '{"method": "ngram", "colour": 1}'], "colour"),
        (["generate", tiny, "-p", "x", "--temperature", "-1"], "temperature"),
        (["generate", tiny], "--prompt"),
        (["bench", tiny, "--workload", "poetry"], "workload"),
        (["generate", str(no_tok), "-p", "x"], "no tokenizer"),
        (["generate", tiny, "-p", "x", "--speculative-config", ngram_inf], "suffix_decoding_max_spec_factor"),
        (["bench", tiny, "--num-prompts", "0"], "num_prompts"),
        (["bench", tiny, "--output", str(tmp / "no" / "dir" / "b.json")], "folder does not exist"),
        (
            ["bench", tiny, "--speculative-config", '{"method": "eagle3", "model": "x"}'],
            "speculative_config.model",
        ),
    ]


@pytest.mark.parametrize("case", range(15))
def test_bad_input_exits_2_with_one_line(tiny_llama, tmp_path, case):
    args, needle = _bad_inputs(tmp_path, tiny_llama)[case]
    r = _run(*args)
    assert r.returncode == 2, (args, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "Warning" not in ln]
    assert len(lines) <= 2 and needle in r.stderr, r.stderr


def test_generate_extracts_hidden_states(tiny_llama, tmp_path):
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1}
    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    args = [
        "generate",
        tiny_llama,
        "-p",
        "hello",
        "--max-tokens",
        "1",
        "--speculative-config",
        json.dumps(spec),
    ]
    r = _run(*args, "--kv-transfer-config", json.dumps(kv))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "cli.safetensors").is_file()
    bad = _run(*args, "--kv-transfer-config", "{nope")
    assert (
        bad.returncode == 2
        and bad.stderr.count("\n") == 1
        and "kv_transfer_config is not valid JSON" in bad.stderr
    )
