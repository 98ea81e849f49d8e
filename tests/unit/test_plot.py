"""verispec/plot.py: the charts of `verispec bench --plot` and the benchmarks' --plot, from hand-made result rows;
a missing matplotlib is a ValueError naming the extra."""

from __future__ import annotations

import sys

import pytest

from verispec.plot import (
    INSTALL_HINT,
    check_plot_path,
    decode_speed_lines,
    plot_decode_speed,
    plot_spec_decode,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(label: str, tok_per_s: float, per_position: list[float] | None = None) -> dict:
    per = per_position or []
    return {
        "label": label,
        "seconds": 1.0,
        "output_tokens": int(tok_per_s),
        "tok_per_s": tok_per_s,
        "mean_acceptance_length": 1 + sum(per),
        "per_position": per,
    }


SPEC_ROWS = [
    _row("verispec plain", 40.0),
    _row("verispec ngram K=2", 55.0, [0.6, 0.4]),
    _row("verispec suffix planner", 81.5, [0.7, 0.55, 0.4, 0.3]),
    _row("transformers prompt-lookup", 22.0),
]

DECODE_RESULT = {
    "model": "tiny",
    "rows": [
        {
            "batch": 1,
            "verispec_tok_s": 50.0,
            "verispec_float32_tok_s": 30.0,
            "transformers_tok_s": 20.0,
            "verispec_int8_runs": [[61.0, 70.0, 0.1], [55.0, 66.0, 0.1], [70.0, 75.0, 0.1]],
        },
        {
            "batch": 8,
            "verispec_tok_s": 240.0,
            "verispec_float32_tok_s": 150.0,
            "transformers_tok_s": None,
            "verispec_int8_runs": None,
        },
    ],
    "llama_cpp_batch1": {"tok_s": 72.0, "decode_tok_s": 80.0},
}


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    # a drawn chart, not an empty canvas
    assert len(data) > 15_000


def test_spec_decode_chart_is_a_png(tmp_path):
    out = tmp_path / "spec.png"
    plot_spec_decode(SPEC_ROWS, out, "tiny, code-edit, batch 1")
    _assert_png(out)


def test_spec_decode_chart_without_speculative_rows(tmp_path):
    out = tmp_path / "plain.png"
    plot_spec_decode(SPEC_ROWS[:1], out)
    _assert_png(out)


def test_spec_decode_chart_writes_svg(tmp_path):
    out = tmp_path / "spec.svg"
    plot_spec_decode(SPEC_ROWS, out)
    assert out.read_text().lstrip().startswith("<?xml") and "per-position acceptance" in out.read_text()


def test_decode_speed_lines_keep_the_engines_the_run_has():
    lines = decode_speed_lines(DECODE_RESULT)
    assert lines == {
        "verispec": [(1, 50.0), (8, 240.0)],
        # the median of the int8 runs' end-to-end tok/s
        "verispec int8 activations": [(1, 61.0)],
        "verispec float32 weights": [(1, 30.0), (8, 150.0)],
        "transformers": [(1, 20.0)],
        "llama.cpp": [(1, 72.0)],
    }


def test_decode_speed_chart_is_a_png(tmp_path):
    out = tmp_path / "decode.png"
    plot_decode_speed(DECODE_RESULT, out)
    _assert_png(out)


def test_empty_results_are_refused(tmp_path):
    with pytest.raises(ValueError, match="baseline"):
        plot_spec_decode([], tmp_path / "x.png")
    with pytest.raises(ValueError, match="no rows"):
        plot_decode_speed({"rows": []}, tmp_path / "x.png")


def test_check_plot_path_names_the_problem(tmp_path):
    check_plot_path(tmp_path / "ok.png")
    with pytest.raises(ValueError, match=r"\.png, \.svg, \.pdf"):
        check_plot_path(tmp_path / "chart.jpeg")
    with pytest.raises(ValueError, match="folder does not exist"):
        check_plot_path(tmp_path / "missing" / "chart.png")


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    # None in sys.modules makes `import matplotlib` raise ImportError, as on an install without the extra
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ValueError, match=r"pip install 'verispec\[plot\]'") as e:
        check_plot_path(tmp_path / "x.png")
    assert INSTALL_HINT in str(e.value)
    with pytest.raises(ValueError, match="matplotlib"):
        plot_spec_decode(SPEC_ROWS, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
