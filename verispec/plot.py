"""Charts of benchmark results, for `verispec bench --plot` and the benchmarks' `--plot` (the optional extra:
`pip install 'verispec[plot]'`).

Pure functions from the result rows the benchmarks already produce to an image file. matplotlib is imported here
only, lazily, and drawn with its Agg renderer on a bare `Figure` (no pyplot, no display, no global state).
"""

from __future__ import annotations

import importlib
import statistics
from pathlib import Path

INSTALL_HINT = "pip install 'verispec[plot]'"
# image formats the Agg renderer and its siblings write, by file suffix
FORMATS = (".png", ".svg", ".pdf")
# bar colours: verispec's speculative rows, its plain baseline, other engines
SPEC_COLOR, PLAIN_COLOR, PEER_COLOR = "tab:blue", "tab:gray", "tab:orange"


def _require_matplotlib() -> None:
    """ValueError naming the extra when matplotlib is missing."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise ValueError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from None


def _figure(width: float, height: float, panels: int = 1):
    """A bare Agg figure and its axes (one, or an array of `panels`)."""
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels)
    return fig, axes


def check_plot_path(path: str | Path) -> None:
    """Everything that can make `--plot path` fail, checked before a long run: matplotlib is importable, the
    suffix is one of FORMATS and the folder exists. ValueError naming what is wrong."""
    _require_matplotlib()
    p = Path(path)
    if p.suffix.lower() not in FORMATS:
        raise ValueError(f"--plot {path}: the file must end in one of {', '.join(FORMATS)}")
    if not p.resolve().parent.is_dir():
        raise ValueError(f"--plot {path}: its folder does not exist")


def _tok_s(value: float) -> str:
    """Three significant figures at most, no exponent: 2.47, 38.5, 412."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _is_peer(label: str) -> bool:
    """Rows of other engines (benchmarks/spec_decode.py --peer: transformers, llama.cpp)."""
    return label.startswith(("transformers", "llama.cpp"))


def plot_spec_decode(rows: list[dict], path: str | Path, title: str = "") -> None:
    """Speculative decoding against plain decoding, two panels.

    rows: BenchResult dicts (`dataclasses.asdict`), the first one the plain baseline; the others one per method,
    fixed K, planner or peer engine. Left: each row's end-to-end tok/s over the baseline's. Right: each speculative
    row's per-position acceptance (the fraction of drafts whose token k was accepted, k = 1..K), with its mean
    acceptance length in the legend."""
    if not rows:
        raise ValueError("plot_spec_decode needs at least the baseline row")
    base = rows[0]["tok_per_s"]
    fig, (left, right) = _figure(11, 1.2 + 0.45 * max(len(rows), 4), panels=2)
    from matplotlib.ticker import MaxNLocator

    labels = [r["label"] for r in rows]
    speedups = [r["tok_per_s"] / base for r in rows]
    colors = [
        PLAIN_COLOR if i == 0 else PEER_COLOR if _is_peer(lab) else SPEC_COLOR for i, lab in enumerate(labels)
    ]
    # top to bottom in the rows' order
    y = list(range(len(rows)))[::-1]
    left.barh(y, speedups, color=colors)
    left.set_yticks(y, labels)
    left.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    for yi, s, r in zip(y, speedups, rows):
        left.text(s, yi, f" {s:.2f}x ({_tok_s(r['tok_per_s'])} tok/s)", va="center", fontsize=8)
    left.set_xlim(0, max(speedups) * 1.45)
    left.set_xlabel(f"speedup over {labels[0]} (end-to-end tok/s)")
    left.set_title("throughput")
    spec_rows = [r for r in rows[1:] if r.get("per_position")]
    for r in spec_rows:
        k = range(1, len(r["per_position"]) + 1)
        name = f"{r['label']} (mean AL {r['mean_acceptance_length']:.2f})"
        right.plot(k, r["per_position"], marker="o", label=name)
    if spec_rows:
        right.legend(fontsize=8, loc="upper right")
        right.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        right.text(0.5, 0.5, "no speculative rows", ha="center", va="center", transform=right.transAxes)
    right.set_ylim(0, 1.05)
    right.set_xlabel("draft position k")
    right.set_ylabel("accepted / drafts")
    right.set_title("per-position acceptance")
    right.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)


def decode_speed_lines(result: dict) -> dict[str, list[tuple[int, float]]]:
    """benchmarks/decode_speed.py's JSON -> engine -> [(batch size, end-to-end tok/s)], for the engines the run
    has: verispec (default: weights kept quantized), its int8-activation and float32-weight variants,
    transformers, and llama.cpp (batch 1 only)."""
    lines: dict[str, list[tuple[int, float]]] = {}

    def add(name: str, batch: int, value: float | None) -> None:
        if value:
            lines.setdefault(name, []).append((batch, value))

    for r in result["rows"]:
        b = r["batch"]
        add("verispec", b, r["verispec_tok_s"])
        int8 = r.get("verispec_int8_runs")
        add("verispec int8 activations", b, statistics.median(x[0] for x in int8) if int8 else None)
        add("verispec float32 weights", b, r.get("verispec_float32_tok_s"))
        add("transformers", b, r.get("transformers_tok_s"))
    peer = result.get("llama_cpp_batch1")
    if peer:
        add("llama.cpp", 1, peer["tok_s"])
    return lines


def plot_decode_speed(result: dict, path: str | Path, title: str = "") -> None:
    """Plain decoding speed by batch size, one line per engine (`decode_speed_lines`); log-2 batch axis."""
    lines = decode_speed_lines(result)
    if not lines:
        raise ValueError("plot_decode_speed: the result has no rows")
    fig, ax = _figure(7, 4.5)
    styles = {"verispec": "-o", "transformers": "--s", "llama.cpp": "D"}
    for name, points in lines.items():
        batches, speeds = zip(*sorted(points))
        ax.plot(batches, speeds, styles.get(name, "-o"), label=name, markersize=7)
    sizes = sorted({b for points in lines.values() for b, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch size (concurrent sequences)")
    ax.set_ylabel("tok/s (all sequences, end to end)")
    ax.set_title(title or f"plain greedy decoding, {result.get('model', '')}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
