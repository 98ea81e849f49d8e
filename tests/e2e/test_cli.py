"""`verispec generate` / `bench` / `serve`: the engine flags they share, streaming output, and one-line errors with
exit code 2 for bad input."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verispec.engine.args import EngineArgs

COMMANDS = ("generate", "bench", "audit", "serve")
SPEC = {"method": "ngram", "num_speculative_tokens": 2}
KV = {"kv_connector": "ExampleHiddenStatesConnector"}
# every engine setting away from its default, as flags
ENGINE_ARGV = [
    *"m --tokenizer tok --skip-tokenizer-init --max-model-len 64 --max-num-seqs 3".split(),
    *"--max-num-batched-tokens 77 --dtype float16 --activation-dtype int8 --no-keep-quantized".split(),
    *"--device cpu --seed 5 --threads 1 --kv-cache-memory-bytes 12345 --spec-token-budget 9".split(),
    *"--block-size 32 --no-enable-prefix-caching --kv-cache-dtype bfloat16".split(),
    *"-tp 2 --distributed-init-method tcp://h:1 --nnodes 2 --node-rank 1 -dp 2".split(),
    *["-sc", json.dumps(SPEC), "--kv-transfer-config", json.dumps(KV)],
    *["--per-request-spec-decode-metrics", "detailed"],
]


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verispec", *args], capture_output=True, text=True, timeout=timeout
    )


def _help_flags(argv: list[str], capsys) -> set[str]:
    from verispec.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return set(re.findall(r"(?<![\w-])--?[a-z][\w-]*", capsys.readouterr().out))


def test_generate_bench_serve_share_every_engine_flag(capsys):
    """One definition (EngineArgs.add_cli_args): each subcommand's help lists every engine flag."""
    alone = argparse.ArgumentParser(prog="x")
    EngineArgs.add_cli_args(alone)
    with pytest.raises(SystemExit):
        alone.parse_args(["--help"])
    engine_flags = set(re.findall(r"(?<![\w-])--?[a-z][\w-]*", capsys.readouterr().out)) - {"-h", "--help"}
    named = {"--activation-dtype", "--max-num-batched-tokens", "--kv-cache-memory-bytes", "--tokenizer"}
    assert named | {"--keep-quantized", "--no-keep-quantized", "--speculative-config", "-sc"} <= engine_flags
    for command in COMMANDS:
        argv = [command] + (["-p", "x"] if command == "generate" else [])
        assert engine_flags <= _help_flags(argv, capsys), command


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_setting_is_a_flag_of_every_subcommand(command):
    from verispec.cli import build_parser
    from verispec.server.cli import resolve_config

    argv = [command, *ENGINE_ARGV] + (["-p", "x"] if command == "generate" else [])
    args = build_parser().parse_args(argv)
    engine = resolve_config(args).engine if command == "serve" else EngineArgs.from_cli_args(args)
    default = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        assert getattr(engine, f.name) != getattr(default, f.name), f"{command}: no flag sets {f.name}"
    assert (engine.speculative_config, engine.kv_transfer_config) == (SPEC, KV)
    assert (engine.max_num_batched_tokens, engine.keep_quantized, engine.tokenizer) == (77, False, "tok")


def test_serve_config_file_sets_every_engine_setting_as_its_flag_does(tmp_path):
    """A YAML key per EngineArgs field (dash form) gives the EngineArgs the flags give."""
    import yaml

    from verispec.cli import build_parser
    from verispec.server.cli import resolve_config

    flags = resolve_config(build_parser().parse_args(["serve", *ENGINE_ARGV])).engine
    path = tmp_path / "c.yaml"
    values = {f.name.replace("_", "-"): getattr(flags, f.name) for f in dataclasses.fields(EngineArgs)}
    path.write_text(yaml.safe_dump(values))
    assert resolve_config(build_parser().parse_args(["serve", "--config", str(path)])).engine == flags
    # a flag wins over the file
    args = build_parser().parse_args(["serve", "--config", str(path), "--max-num-seqs", "9", "other"])
    assert (resolve_config(args).engine.max_num_seqs, resolve_config(args).engine.model) == (9, "other")
    # a key that is neither an engine setting nor a server option: named, with the allowed ones
    path.write_text("max-num-seq: 3\n")
    with pytest.raises(ValueError, match=r"unknown option 'max-num-seq'; allowed .*max_num_seqs.*, port, "):
        resolve_config(build_parser().parse_args(["serve", "--config", str(path)]))


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
    # one summary line on stderr
    assert re.search(r"^12 tokens in [\d.]+ s, [\d.]+ tok/s, speculation off$", plain.stderr, re.M), (
        plain.stderr
    )
    summary = (
        r"^12 tokens in [\d.]+ s, [\d.]+ tok/s, drafted \d+ / accepted \d+, mean acceptance length [\d.]+$"
    )
    assert re.search(summary, spec.stderr, re.M), spec.stderr


def test_version():
    from verispec import __version__

    r = _run("--version")
    assert r.returncode == 0 and r.stdout == f"verispec {__version__}\n"


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
