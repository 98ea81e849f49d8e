"""Matmul throughput by row count: verispec's quantized kernel vs MKL float32 on the same (dequantized) weights.

For M rows (1 = batch-1 decode, 5 = verifying 4 drafts, 8 = batch-8 decode, 256 = a prompt), one sweep over every
quantized projection of the decoder layers (the LM head excluded), in layer order so the weights come from memory
as in a real step; best of --reps sweeps. Prints ms per sweep and GMAC/s and writes JSON.
--baseline REF adds the kernels of git revision REF (built from its sources), swept in the same process on the
same weights: an A/B that this VM's run-to-run drift cannot blur.
    .venv/bin/python benchmarks/kernel_sweep.py [--model smollm2-135m-instruct] [--rows 1,2,4,5,8,16,64,256]
        [--baseline REF]
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


def baseline_kernels(ref: str):
    """The kernel library built from git revision `ref`'s sources (same ISA and flags as this build's)."""
    from verispec.kernels import build

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for src in build.SOURCES:
            show = subprocess.run(
                ["git", "show", f"{ref}:{src.relative_to(root)}"], cwd=root, capture_output=True
            )
            if show.returncode != 0:
                print(f"--baseline {ref}: {show.stderr.decode().strip()}", file=sys.stderr)
                raise SystemExit(2)
            paths.append(Path(tmp) / src.name)
            paths[-1].write_bytes(show.stdout)
        lib = build.build_qgemm(build.kernel_isa(), tuple(paths))  # compiled into the kernel cache
    if lib is None:
        print(f"--baseline {ref}: its kernels did not build", file=sys.stderr)
        raise SystemExit(2)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,2,4,5,8,16,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline", help="git revision whose kernels to sweep side by side")
    ap.add_argument("--output", default="bench_results/kernel_sweep.json")
    args = ap.parse_args()
    from verispec import LLM

    base = baseline_kernels(args.baseline) if args.baseline else None  # fail before the model loads
    llm = LLM(args.model, max_model_len=64, max_num_seqs=1)
    head = llm.ckpt.model.lm_head
    qws = [
        m.qweight
        for m in llm.ckpt.model.modules()
        if getattr(m, "qweight", None) is not None and m is not head
    ]
    if not qws:
        raise SystemExit(
            f"{args.model}: no weights kept quantized here (no kernels, or an unsupported GGUF type)"
        )
    dense = [q.dequantize() for q in qws]  # float32 [N, K], exactly the values the kernel multiplies with
    macs_per_row = sum(q.shape[0] * q.shape[1] for q in qws)
    rows = []
    print(f"model={args.model} weights={len(qws)} threads={torch.get_num_threads()} (LM head excluded)")
    extra = f" {args.baseline[:10] + ' ms':>13} {'x':>5}" if base else ""
    print(f"{'M':>5} {'qgemm ms':>9} {'GMAC/s':>7} {'MKL f32 ms':>11} {'GMAC/s':>7}{extra}")
    for m in [int(x) for x in args.rows.split(",")]:
        xs = {k: torch.randn(m, k) for k in {q.shape[1] for q in qws}}
        ours = best_sweep([lambda q=q, x=xs[q.shape[1]]: q.matmul(x) for q in qws], args.reps)
        mkl = best_sweep(
            [lambda w=w, x=xs[w.shape[1]]: torch.nn.functional.linear(x, w) for w in dense], args.reps
        )
        r = {"rows": m, "qgemm_s": ours, "mkl_f32_s": mkl, "qgemm_gmacs": m * macs_per_row / ours / 1e9,
             "mkl_f32_gmacs": m * macs_per_row / mkl / 1e9}  # fmt: skip
        line = f"{m:>5} {ours * 1e3:>9.1f} {r['qgemm_gmacs']:>7.1f} {mkl * 1e3:>11.1f} {r['mkl_f32_gmacs']:>7.1f}"
        if base is not None:
            r["baseline_s"] = best_sweep(
                [lambda q=q, x=xs[q.shape[1]]: q.matmul(x, base) for q in qws], args.reps
            )
            line += f" {r['baseline_s'] * 1e3:>13.1f} {r['baseline_s'] / ours:>4.2f}x"
        rows.append(r)
        print(line)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps({"model": args.model, "baseline": args.baseline, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
