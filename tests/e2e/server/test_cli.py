"""`verispec serve`'s command line (verispec/server/cli.py): flag > config file > environment, and bad flags exit 2
with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import NGRAM, ROOT


def test_cli_config_resolution(tmp_path, monkeypatch):
    import argparse

    from verispec.cli import build_parser
    from verispec.server.cli import add_serve_args, resolve_config

    monkeypatch.setenv("VERISPEC_API_KEY", "from-env")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        "port: 9001\nmax_num_seqs: 3\nspeculative-config:\n  method: ngram\n"
        "  num_speculative_tokens: 2\nserved-model-name: a\n"
    )
    p = argparse.ArgumentParser()
    add_serve_args(p)
    cfg = resolve_config(p.parse_args(["m", "--config", str(cfg_file), "--port", "9002"]))
    assert (cfg.engine.model, cfg.engine.max_num_seqs) == ("m", 3)
    assert (cfg.port, cfg.served_model_name) == (9002, ["a"])
    assert cfg.engine.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert cfg.api_key == "from-env" and cfg.host == "127.0.0.1"
    cfg = resolve_config(
        p.parse_args(["--config", str(cfg_file), "-sc", json.dumps(NGRAM), "--api-key", "k"])
    )
    assert cfg.engine.speculative_config == NGRAM and cfg.api_key == "k"
    assert cfg.engine.model == "smollm2-135m-instruct"
    bad = tmp_path / "bad.yaml"
    for text, needle in [
        ("max_num_seq: 3\n", "unknown option"),
        ("port: eighty\n", "integer"),
        ("speculative-config: [1]\n", "mapping"),
        ("- a\n", "mapping"),
        ("a: [\n", "YAML"),
        (
            "speculative-config: {method: ngram}\nper-request-spec-decode-metrics: full\n",
            "per_request_spec_decode_metrics='full' is not supported; allowed: none, summary, detailed",
        ),
        ("per-request-spec-decode-metrics: summary\n", "requires speculative decoding"),
    ]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=needle):
            resolve_config(p.parse_args(["--config", str(bad)]))
    # the main CLI's subcommand
    args = build_parser().parse_args(["serve", "m", "--port", "1234", "-sc", "{}"])
    assert args.port == 1234 and callable(args.func)


def _serve(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """`verispec serve` with args (and env over this process's), its output captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "verispec.server.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_cli_bad_flags_exit_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_option: 1\n")
    cases = [
        ["--port", "eighty"],
        ["m", "-sc", "{not json"],
        ["m", "--config", str(bad)],
        [str(tmp_path / "missing-model")],
        ["m", "--per-request-spec-decode-metrics", "summary"],
        ["m", "-sc", '{"method": "ngram"}', "--per-request-spec-decode-metrics", "full"],
        ["m", "--shutdown-timeout", "-1"],
        ["m", "--kv-cache-dtype", "fp8"],
    ]
    procs = [_serve(c) for c in cases]
    for c, proc in zip(cases, procs):
        out, err = proc.communicate(timeout=120)
        lines = [x for x in err.splitlines() if x.strip()]
        assert proc.returncode == 2, (c, err)
        assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in err, (c, err)


def test_a_blank_api_key_refuses_to_start(tmp_path):
    """`--api-key "$KEY"` with KEY unset must not serve without authentication: exit 2, one line naming where the
    blank key came from, before the model is loaded."""
    cfg = tmp_path / "blank.yaml"
    cfg.write_text('api-key: " "\n')
    cases = [
        (["m", "--api-key", ""], {}, "--api-key"),
        (["m", "--api-key", "  \t"], {}, "--api-key"),
        (["m", "--config", str(cfg)], {}, "api-key"),
        (["m"], {"VERISPEC_API_KEY": ""}, "VERISPEC_API_KEY"),
        (["m", "--api-key", " padded "], {}, "--api-key"),
    ]
    procs = [_serve(args, env) for args, env, _ in cases]
    for (args, _, needle), proc in zip(cases, procs):
        _, err = proc.communicate(timeout=120)
        lines = [x for x in err.splitlines() if x.strip()]
        assert proc.returncode == 2 and len(lines) == 1, (args, err)
        assert needle in lines[0] and "Traceback" not in err, (args, err)
