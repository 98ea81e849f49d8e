"""Matmul throughput by row count: verispec's quantized kernels (float32 activations, and int8 activations:
activation_dtype="int8") vs MKL float32 on the same (dequantized) weights.

For M rows (1 = batch-1 decode, 5 = verifying 4 drafts, 8 = batch-8 decode, 256 = a prompt), one sweep over every
quantized projection of the decoder layers, in layer order so the weights come from memory as in a real step, and
the LM head separately; best of --reps sweeps, every kernel's sweeps taking turns. Prints ms per sweep and GMAC/s and writes JSON.
The int8 columns run the same weights in the int8 kernels' layouts (q4v / q8v) with the variant --int8-isa names
(default: the best this CPU has; `all`: one column group per variant it runs; `none`: no int8 columns); the last
lines give each kernel's cost of M rows against 1 row (verifying 4 drafts is M = 5).
--step adds what the engine pays: its whole forward over M rows behind a 256-token context (the start-up profile
of the draft-length planner, verispec/planner/step_cost.py: fused layers, attention, the LM head), float32 and int8
activations. The sweep above calls each projection from Python, so its small-row figures carry per-call overhead
that the engine's fused layers do not have.
--baseline REF / --baseline-isa ISA add the kernels of git revision REF (built from its sources) or of another
build of these sources (avx512, avx2: e.g. the FMA kernels against the AMX ones), swept in the same process on the
same weights (in the layout each build reads): an A/B that this VM's run-to-run drift cannot blur (with int8 columns,
the baseline's int8 kernel too, on the first --int8-isa variant).
    .venv/bin/python benchmarks/kernel_sweep.py [--model smollm2-135m-instruct] [--rows 1,2,4,5,8,16,64,256]
        [--baseline REF] [--baseline-isa avx512] [--int8-isa best|all|none|amx-int8|avx512vnni|avxvnni]
        [--int8-wide] [--cached]
--int8-wide adds the same weights in the wide int8 layouts (q4v / q6v / q8v) on the first int8 variant, with the
time against the compact ones (q4kv / q6kv / q5v) in the same process.
--cached adds the first int8 variant with every weight replaced by the first one of its shape and layout: the same
calls with the weights in cache, so the ratio says what streaming them from memory costs at each row count.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def best_sweeps(sweeps: dict[str, list], reps: int) -> dict[str, float]:
    """name -> the best of reps timings of one sweep (its functions called in order). The sweeps take turns, one
    timing each per round, so a busy spell of this shared VM falls on all of them alike; the order is shuffled each
    round."""
    best = {name: float("inf") for name in sweeps}
    names = list(sweeps)
    for i in range(reps):
        # each round in another order, so that no sweep always follows the same one (the tile unit's or not)
        for name in random.Random(i).sample(names, len(names)):
            fns = sweeps[name]
            t = time.perf_counter()
            for f in fns:
                f()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def baseline_kernels(ref: str | None, isa: str):
    """The kernel library for `isa` built from git revision `ref`'s sources (None: this checkout's)."""
    from verispec.kernels import build

    if ref is None:
        lib = build.build_qgemm(isa)
    else:
        root = Path(__file__).resolve().parents[1]
        names = [*build.SOURCES, build.AMX_SOURCE] if isa == "amx" else list(build.SOURCES)
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for src in names:
                show = subprocess.run(
                    ["git", "show", f"{ref}:{src.relative_to(root)}"], cwd=root, capture_output=True
                )
                if show.returncode != 0:
                    print(f"--baseline {ref}: {show.stderr.decode().strip()}", file=sys.stderr)
                    raise SystemExit(2)
                paths.append(Path(tmp) / src.name)
                paths[-1].write_bytes(show.stdout)
            # the headers the sources include: every one that revision has beside them (older ones have none)
            folder = build.HEADER.parent.relative_to(root)
            listing = subprocess.run(
                ["git", "ls-tree", "--name-only", ref, f"{folder}/"], cwd=root, capture_output=True, text=True
            )
            for name in (n for n in listing.stdout.split() if n.endswith(".h")):
                show = subprocess.run(["git", "show", f"{ref}:{name}"], cwd=root, capture_output=True)
                (Path(tmp) / Path(name).name).write_bytes(show.stdout)
            # compiled into the kernel cache
            lib = build.build_qgemm(isa, tuple(paths[: len(build.SOURCES)]))
    if lib is None:
        print(f"baseline {ref or 'this checkout'} ({isa}): its kernels did not build", file=sys.stderr)
        raise SystemExit(2)
    return lib


def int8_variants(choice: str, lib) -> list[str]:
    """The int8 variants to sweep: `best` (this CPU's choice), `all` (every one it runs), `none`, or one by name;
    an empty list, with a line saying why, where the CPU has none."""
    from verispec.kernels import build

    if choice == "none":
        return []
    best = build.int8_isa(lib)
    if best is None:
        print(
            "int8 columns skipped: this CPU has no AVX512-VNNI, AVX-VNNI or AMX-INT8 (or no kernel library)"
        )
        return []
    if choice == "best":
        return [best]
    usable = []
    for name, (code, need) in build.INT8_ISAS.items():
        if need <= build._cpu_flags() and lib.qgemm_i8_isas() >> code & 1:
            if name != "amx-int8" or lib.i8_amx_init():
                usable.append(name)
    if choice == "all":
        return usable
    if choice not in usable:
        print(f"--int8-isa {choice}: not one this CPU runs ({', '.join(usable)})", file=sys.stderr)
        raise SystemExit(2)
    return [choice]


def forward_steps(model: str, rows: list[int], reps: int, int8: bool) -> dict[str, dict[int, float]]:
    """activation dtype -> {rows: seconds of the engine's whole forward}, printed with each ratio to 1 row."""
    from verispec import LLM
    from verispec.planner.step_cost import profile_step_cost

    out = {}
    print("whole forward step, 256-token context (ms; cost against 1 row):")
    for dtype in ("float32", "int8") if int8 else ("float32",):
        llm = LLM(
            model,
            max_model_len=max(rows) + 300,
            max_num_seqs=1,
            activation_dtype=dtype,
            enable_prefix_caching=False,
        )
        steps = profile_step_cost(llm.engine.runner, 0, rows, repeats=max(reps, 8))
        out[dtype] = steps
        one = steps.get(1)
        cells = ", ".join(
            f"M={m} {s * 1e3:.2f}" + (f" ({s / one:.2f}x)" if one and m > 1 else "") for m, s in steps.items()
        )
        print(f"  {dtype:<8} {cells}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,2,4,5,8,16,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline", help="git revision whose kernels to sweep side by side")
    ap.add_argument(
        "--baseline-isa", choices=["avx2", "avx512", "amx"], help="build of the baseline (default: ours)"
    )
    ap.add_argument("--int8-isa", default="best", help="best | all | none | a variant of build.INT8_ISAS")
    ap.add_argument(
        "--int8-wide",
        action="store_true",
        help="also sweep the wide int8 layouts (q4v / q6v / q8v) on the first int8 variant: the compact ones' A/B",
    )
    ap.add_argument(
        "--cached",
        action="store_true",
        help="also sweep the first int8 variant with every weight replaced by the first one of its shape and layout "
        "(the same calls, weights from cache): what streaming them from memory costs at each row count",
    )
    ap.add_argument("--step", action="store_true", help="also time the engine's whole forward per row count")
    ap.add_argument("--output", default="bench_results/kernel_sweep.json")
    args = ap.parse_args()
    from verispec import LLM
    from verispec.kernels import build

    ours_lib = build.load_qgemm()
    base = None
    # fail before the model loads
    if args.baseline or args.baseline_isa:
        base = baseline_kernels(args.baseline, args.baseline_isa or ours_lib.isa)
    i8_isas = int8_variants(args.int8_isa, ours_lib)
    if args.cached and not i8_isas:
        print(
            "--cached sweeps an int8 variant: none runs here (--int8-isa none, or no int8 kernel)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    label = f"{args.baseline or 'HEAD'}"[:10] + (f" {args.baseline_isa}" if args.baseline_isa else "")
    llm = LLM(args.model, max_model_len=64, max_num_seqs=1)
    head = llm.ckpt.model.lm_head.qweight
    qws = [
        m.qweight
        for m in llm.ckpt.model.modules()
        if getattr(m, "qweight", None) is not None and m is not llm.ckpt.model.lm_head
    ]
    if not qws:
        raise SystemExit(
            f"{args.model}: no weights kept quantized here (no kernels, or an unsupported GGUF type)"
        )
    # float32 [N, K], exactly the values the kernel multiplies with
    dense = [q.dequantize() for q in qws]
    base_qws = [q.for_kernels(base) for q in qws] if base else []
    base_head = head.for_kernels(base) if base and head is not None else None
    macs_per_row = sum(q.shape[0] * q.shape[1] for q in qws)
    # the int8 layouts; a weight whose shape has none (N not a multiple of 16) keeps float32 activations, as in a model
    i8_qws = [q.for_int8() or q for q in qws] if i8_isas else []
    i8_head = (head.for_int8() or head) if i8_isas and head is not None else None
    # --int8-wide: the same weights in the wide int8 layouts (q4v / q6v / q8v), on the first variant
    wide = bool(args.int8_wide and i8_isas)
    wide_qws = [q.for_int8(compact=False) or q for q in qws] if wide else []
    wide_head = (head.for_int8(compact=False) or head) if wide and head is not None else None
    # --cached: each int8 weight's stand-in, the first of its shape and layout (a few MB in all: they stay cached)
    first_of = {}
    cached_qws = [first_of.setdefault((q.shape, q.fmt), q) for q in i8_qws] if args.cached else []
    rows = []
    print(
        f"model={args.model} weights={len(qws)} threads={torch.get_num_threads()} kernels={ours_lib.isa} "
        f"(layers; LM head {head.fmt if head is not None else 'float32'} in its own column)"
    )
    extra = f" {label + ' ms':>18} {'x':>5} {'head ms':>8} {'x':>5}" if base else ""
    # the baseline's int8 kernel, where that revision has this variant (older ones lack some: avx2 before session 22)
    code = build.INT8_ISAS[i8_isas[0]][0] if i8_isas else 0
    base_int8 = (
        base is not None and hasattr(base, "qgemm_i8") and bool(i8_isas) and base.qgemm_i8_isas() >> code & 1
    )
    if base_int8:
        extra += f" {'base int8 ms':>15} {'x':>5}"
    extra += "".join(f" {isa + ' ms':>16} {'GMAC/s':>7} {'head ms':>8}" for isa in i8_isas)
    if wide:
        extra += f" {'wide ms':>9} {'x':>5} {'head ms':>8} {'x':>5}"
    if args.cached:
        extra += f" {'cached ms':>10} {'GMAC/s':>7} {'streamed/cached':>15}"
    print(f"{'M':>5} {'qgemm ms':>9} {'GMAC/s':>7} {'MKL f32 ms':>11} {'GMAC/s':>7} {'head ms':>8}{extra}")
    for m in [int(x) for x in args.rows.split(",")]:
        xs = {k: torch.randn(m, k) for k in {q.shape[1] for q in qws}}
        xh = torch.randn(m, head.shape[1]) if head is not None else None
        sweeps = {
            "qgemm": [lambda q=q, x=xs[q.shape[1]]: q.matmul(x) for q in qws],
            "mkl": [lambda w=w, x=xs[w.shape[1]]: torch.nn.functional.linear(x, w) for w in dense],
            "head": [lambda x=xh: head.matmul(x)] if head is not None else [],
        }
        if base is not None:
            sweeps["baseline"] = [lambda q=q, x=xs[q.shape[1]]: q.matmul(x, base) for q in base_qws]
            sweeps["baseline_head"] = [lambda x=xh: base_head.matmul(x, base)] if base_head else []
        if base_int8:
            sweeps["baseline_int8"] = [
                lambda q=q, x=xs[q.shape[1]]: q.matmul(x, base, i8_isas[0]) for q in i8_qws
            ]
        for isa in i8_isas:
            sweeps[f"int8_{isa}"] = [
                lambda q=q, x=xs[q.shape[1]], isa=isa: q.matmul(x, ours_lib, isa) for q in i8_qws
            ]
            sweeps[f"int8_{isa}_head"] = (
                [lambda x=xh, isa=isa: i8_head.matmul(x, ours_lib, isa)] if i8_head is not None else []
            )
        if wide:
            sweeps["int8_wide"] = [
                lambda q=q, x=xs[q.shape[1]]: q.matmul(x, ours_lib, i8_isas[0]) for q in wide_qws
            ]
            sweeps["int8_wide_head"] = (
                [lambda x=xh: wide_head.matmul(x, ours_lib, i8_isas[0])] if wide_head is not None else []
            )
        if args.cached:
            sweeps["int8_cached"] = [
                lambda q=q, x=xs[q.shape[1]]: q.matmul(x, ours_lib, i8_isas[0]) for q in cached_qws
            ]
        t = {k: (v if sweeps[k] else float("nan")) for k, v in best_sweeps(sweeps, args.reps).items()}
        ours, mkl, ours_head = t["qgemm"], t["mkl"], t["head"]
        r = {
            "rows": m,
            "qgemm_s": ours,
            "mkl_f32_s": mkl,
            "qgemm_gmacs": m * macs_per_row / ours / 1e9,
            "mkl_f32_gmacs": m * macs_per_row / mkl / 1e9,
            "head_s": ours_head,
        }
        line = (
            f"{m:>5} {ours * 1e3:>9.1f} {r['qgemm_gmacs']:>7.1f} {mkl * 1e3:>11.1f} {r['mkl_f32_gmacs']:>7.1f}"
            f" {ours_head * 1e3:>8.2f}"
        )
        if base is not None:
            r["baseline_s"], r["baseline_head_s"] = t["baseline"], t["baseline_head"]
            line += f" {r['baseline_s'] * 1e3:>18.1f} {r['baseline_s'] / ours:>4.2f}x"
            line += f" {r['baseline_head_s'] * 1e3:>8.2f} {r['baseline_head_s'] / ours_head:>4.2f}x"
        if "baseline_int8" in t:
            r["baseline_int8_s"] = t["baseline_int8"]
            line += (
                f" {t['baseline_int8'] * 1e3:>15.1f} {t['baseline_int8'] / t[f'int8_{i8_isas[0]}']:>4.2f}x"
            )
        for isa in i8_isas:
            r[f"int8_{isa}_s"], r[f"int8_{isa}_head_s"] = t[f"int8_{isa}"], t[f"int8_{isa}_head"]
            r[f"int8_{isa}_gmacs"] = m * macs_per_row / r[f"int8_{isa}_s"] / 1e9
            line += f" {r[f'int8_{isa}_s'] * 1e3:>16.1f} {r[f'int8_{isa}_gmacs']:>7.1f}"
            line += f" {r[f'int8_{isa}_head_s'] * 1e3:>8.2f}"
        if wide:
            r["int8_wide_s"], r["int8_wide_head_s"] = t["int8_wide"], t["int8_wide_head"]
            first = f"int8_{i8_isas[0]}"
            line += f" {t['int8_wide'] * 1e3:>9.1f} {t['int8_wide'] / t[first]:>4.2f}x"
            line += f" {t['int8_wide_head'] * 1e3:>8.2f} {t['int8_wide_head'] / t[first + '_head']:>4.2f}x"
        if args.cached:
            r["int8_cached_s"] = t["int8_cached"]
            r["int8_cached_gmacs"] = m * macs_per_row / t["int8_cached"] / 1e9
            streamed = t[f"int8_{i8_isas[0]}"] / t["int8_cached"]
            line += f" {t['int8_cached'] * 1e3:>10.1f} {r['int8_cached_gmacs']:>7.1f} {streamed:>14.2f}x"
        rows.append(r)
        print(line)
    by_rows = {r["rows"]: r for r in rows}
    if 1 in by_rows:
        print("cost of M rows / 1 row (layers; layers + LM head):")
        kernels = [("float32 act", "qgemm_s", "head_s")] + [
            (isa, f"int8_{isa}_s", f"int8_{isa}_head_s") for isa in i8_isas
        ]
        for name, key, hkey in kernels:
            one, one_h = by_rows[1][key], by_rows[1][key] + by_rows[1][hkey]
            ratios = ", ".join(
                f"M={m} {r[key] / one:.2f}x ({(r[key] + r[hkey]) / one_h:.2f}x)"
                for m, r in by_rows.items()
                if m > 1
            )
            print(f"  {name:<12} {ratios}")
        if i8_isas:
            isa = i8_isas[0]
            speedups = ", ".join(
                f"M={m} {r['qgemm_s'] / r[f'int8_{isa}_s']:.2f}x" for m, r in by_rows.items()
            )
            print(f"int8 ({isa}) against float32 activations, same rows (layers): {speedups}")
    steps = forward_steps(args.model, sorted(by_rows), args.reps, bool(i8_isas)) if args.step else {}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps(
            {
                "model": args.model,
                "kernels": ours_lib.isa,
                "baseline": args.baseline,
                "baseline_isa": args.baseline_isa,
                "int8_isas": i8_isas,
                "rows": rows,
                "forward_step_s": steps,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
