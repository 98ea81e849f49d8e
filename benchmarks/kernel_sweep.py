"""Matmul throughput by row count: verispec's quantized kernel vs MKL float32 on the same (dequantized) weights.

For M rows (1 = batch-1 decode, 5 = verifying 4 drafts, 8 = batch-8 decode, 256 = a prompt), one sweep over every
quantized projection of the decoder layers, in layer order so the weights come from memory as in a real step, and
the LM head separately; best of --reps sweeps. Prints ms per sweep and GMAC/s and writes JSON.
--baseline REF / --baseline-isa ISA add the kernels of git revision REF (built from its sources) or of another
build of these sources (avx512, avx2: e.g. the FMA kernels against the AMX ones), swept in the same process on the
same weights (in the layout each build reads): an A/B that this VM's run-to-run drift cannot blur.
    .venv/bin/python benchmarks/kernel_sweep.py [--model smollm2-135m-instruct] [--rows 1,2,4,5,8,16,64,256]
        [--baseline REF] [--baseline-isa avx512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def best_sweep(fns, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for f in fns:
            f()
        best = min(best, time.perf_counter() - t)
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
            lib = build.build_qgemm(isa, tuple(paths[: len(build.SOURCES)]))  # compiled into the kernel cache
    if lib is None:
        print(f"baseline {ref or 'this checkout'} ({isa}): its kernels did not build", file=sys.stderr)
        raise SystemExit(2)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,2,4,5,8,16,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline", help="git revision whose kernels to sweep side by side")
    ap.add_argument(
        "--baseline-isa", choices=["avx2", "avx512", "amx"], help="build of the baseline (default: ours)"
    )
    ap.add_argument("--output", default="bench_results/kernel_sweep.json")
    args = ap.parse_args()
    from verispec import LLM
    from verispec.kernels import build

    ours_lib = build.load_qgemm()
    base = None
    if args.baseline or args.baseline_isa:  # fail before the model loads
        base = baseline_kernels(args.baseline, args.baseline_isa or ours_lib.isa)
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
    dense = [q.dequantize() for q in qws]  # float32 [N, K], exactly the values the kernel multiplies with
    base_qws = [q.for_kernels(base) for q in qws] if base else []
    base_head = head.for_kernels(base) if base and head is not None else None
    macs_per_row = sum(q.shape[0] * q.shape[1] for q in qws)
    rows = []
    print(
        f"model={args.model} weights={len(qws)} threads={torch.get_num_threads()} kernels={ours_lib.isa} "
        f"(layers; LM head {head.fmt if head is not None else 'float32'} in its own column)"
    )
    extra = f" {label + ' ms':>18} {'x':>5} {'head ms':>8} {'x':>5}" if base else ""
    print(f"{'M':>5} {'qgemm ms':>9} {'GMAC/s':>7} {'MKL f32 ms':>11} {'GMAC/s':>7} {'head ms':>8}{extra}")
    for m in [int(x) for x in args.rows.split(",")]:
        xs = {k: torch.randn(m, k) for k in {q.shape[1] for q in qws}}
        ours = best_sweep([lambda q=q, x=xs[q.shape[1]]: q.matmul(x) for q in qws], args.reps)
        mkl = best_sweep(
            [lambda w=w, x=xs[w.shape[1]]: torch.nn.functional.linear(x, w) for w in dense], args.reps
        )
        xh = torch.randn(m, head.shape[1]) if head is not None else None
        ours_head = best_sweep([lambda x=xh: head.matmul(x)], args.reps) if head is not None else float("nan")
        r = {"rows": m, "qgemm_s": ours, "mkl_f32_s": mkl, "qgemm_gmacs": m * macs_per_row / ours / 1e9,
             "mkl_f32_gmacs": m * macs_per_row / mkl / 1e9, "head_s": ours_head}  # fmt: skip
        line = (
            f"{m:>5} {ours * 1e3:>9.1f} {r['qgemm_gmacs']:>7.1f} {mkl * 1e3:>11.1f} {r['mkl_f32_gmacs']:>7.1f}"
            f" {ours_head * 1e3:>8.2f}"
        )
        if base is not None:
            r["baseline_s"] = best_sweep(
                [lambda q=q, x=xs[q.shape[1]]: q.matmul(x, base) for q in base_qws], args.reps
            )
            r["baseline_head_s"] = (
                best_sweep([lambda x=xh: base_head.matmul(x, base)], args.reps) if base_head else float("nan")
            )
            line += f" {r['baseline_s'] * 1e3:>18.1f} {r['baseline_s'] / ours:>4.2f}x"
            line += f" {r['baseline_head_s'] * 1e3:>8.2f} {r['baseline_head_s'] / ours_head:>4.2f}x"
        rows.append(r)
        print(line)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps(
            {
                "model": args.model,
                "kernels": ours_lib.isa,
                "baseline": args.baseline,
                "baseline_isa": args.baseline_isa,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
