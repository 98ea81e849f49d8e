"""`verispec bench --plot / --quiet` (verispec/bench.py): the chart is written next to the table and the JSON, and a
missing matplotlib is a one-line error with exit code 2 naming the extra, before any model is loaded."""

from __future__ import annotations

import json
import sys

from verispec.cli import main

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'


def test_bench_writes_the_plot_and_json(tiny_llama, tmp_path, capsys, monkeypatch):
    # the tiny model's 512 positions hold none of the built-in workloads' prompts: two short repetitive ones
    short = [
        [{"role": "user", "content": "a b c a b c a b c a b"}],
        [{"role": "user", "content": "1 2 3 1 2 3 1"}],
    ]
    monkeypatch.setattr("verispec.bench.build_workload", lambda name, n: short[:n])
    png, out = tmp_path / "bench.png", tmp_path / "bench.json"
    argv = [
        "bench",
        tiny_llama,
        "-sc",
        SPEC,
        "--num-prompts",
        "2",
        "--max-tokens",
        "8",
        "--workload",
        "repeat-edit",
    ]
    assert main([*argv, "--output", str(out), "--plot", str(png), "--quiet"]) == 0
    result = json.loads(out.read_text())
    assert result["plain"]["label"] == "plain" and result["spec_run"]["label"] == "ngram"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 15_000
    std = capsys.readouterr()
    assert f"plot: {png}" in std.out
    # --quiet, and no terminal anyway: no bar
    assert "Processed prompts" not in std.err


def test_bench_plot_without_matplotlib_exits_2(tiny_llama, tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    # a model that does not exist: the plot check comes first, so nothing is loaded
    assert main(["bench", "no-such-model", "--plot", str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "verispec: error: --plot needs matplotlib, which is not installed: pip install 'verispec[plot]'"
    ]
    assert not (tmp_path / "b.png").exists()


def test_bench_plot_path_is_checked_first(tmp_path, capsys):
    assert main(["bench", "no-such-model", "--plot", str(tmp_path / "b.jpeg")]) == 2
    assert ".png, .svg, .pdf" in capsys.readouterr().err


def test_bench_runs_data_parallel_replicas(tiny_llama, tmp_path, capsys, monkeypatch):
    """`verispec bench -dp 2`: both runs on two replica processes, the speculative counters summed over them, the
    outputs equal to plain decoding's."""
    short = [
        [{"role": "user", "content": "a b c a b c a b c a b"}],
        [{"role": "user", "content": "1 2 3 1 2 3 1"}],
    ]
    monkeypatch.setattr("verispec.bench.build_workload", lambda name, n: short[:n])
    out = tmp_path / "bench.json"
    # fixed K, so that the tiny model drafts in its 8 tokens
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "enable_adaptive_verification": false}'
    argv = ["bench", tiny_llama, "-sc", spec, "-dp", "2", "--num-prompts", "2", "--batch-size", "2"]
    assert main([*argv, "--max-tokens", "8", "--output", str(out), "--quiet"]) == 0
    result = json.loads(out.read_text())
    assert result["identical_outputs"] == 2
    assert result["spec_run"]["num_draft_tokens"] > 0
    assert "identical outputs (greedy check): 2/2" in capsys.readouterr().out
