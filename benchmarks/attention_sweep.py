"""Attention over the KV cache: the fused C kernel (kernels/ops.c) by batch size and context length, and on prompts.

SmolLM2-135M's shapes by default (9 query heads sharing 3 KV heads, head dim 64); one query row per sequence (plain
decode) or 5 (verifying 4 drafts); --prompts adds fresh prompts of those lengths (every row attends causally to the
rows up to it: prompt processing). As in a decode step, each call reads its own layer's cache (--layers caches, used
in turn) after --between-mb of other memory has been streamed (a layer's weights): the keys and values come from
memory, not from a cache the previous call warmed (--layers 1 --between-mb 0 measures that hot case instead).
Prints the median microseconds per layer call and writes JSON. --baseline REF adds the kernels of git revision REF,
run in the same process on the same inputs, and checks that both give bitwise the same outputs. --kv-dtypes adds
columns for caches storing K/V as float16 / bfloat16 (kv_cache_dtype), each against the float32 cache.
    .venv/bin/python benchmarks/attention_sweep.py [--baseline REF] [--contexts 128,512,1000] [--batches 1,8]
        [--prompts 256,1024] [--layers 30] [--between-mb 4] [--kv-dtypes float32,float16,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from adaptive_k import cpu_model, int_list
from kernel_sweep import baseline_kernels

from verispec.kernels.ops import KV_DTYPE_CODES


def attention_call(lib, q, cache, hkv: int, t: int, out, mask=None):
    """mask: None (every row attends to all t keys) or [1, 1, nq, t] bool, contiguous (the same for every sequence)."""
    s, hq, nq, d = q.shape
    t_alloc = cache.shape[2]
    # a contiguous cache (no block table), every row real (qlen NULL); a baseline may predate some arguments: qlen
    # (24 of them), the block table (26), kv_dtype (27)
    n_args = len(lib.attention_f32.argtypes)
    qlen = (None,) if n_args >= 24 else ()
    paged = (None, 0, 0) if n_args >= 26 else ()
    kv = (KV_DTYPE_CODES[cache.dtype],) if n_args >= 27 else ()
    return lambda: lib.attention_f32(
        q.data_ptr(),
        s,
        hq,
        nq,
        d,
        hq * nq * d,
        nq * d,
        d,
        cache.data_ptr(),
        cache[:, hkv:].data_ptr(),
        hkv,
        t,
        2 * hkv * t_alloc * d,
        t_alloc * d,
        d,
        *paged,
        None if mask is None else mask.data_ptr(),
        0,
        0 if mask is None else t,
        d**-0.5,
        0.0,
        out.data_ptr(),
        *qlen,
        torch.get_num_threads(),
        *kv,
    )


def median_call(calls, reps: int, stream: torch.Tensor, between: int) -> float:
    """Median seconds of one call over reps rounds of all `calls` (one per layer), each preceded (untimed) by a
    read of `between` floats of `stream` at a moving offset."""
    for c in calls:
        c()
    times, off = [], 0
    for _ in range(reps):
        for c in calls:
            if between:
                off = (off + between) % (stream.numel() - between + 1)
                stream[off : off + between].sum()
            t = time.perf_counter()
            c()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int_list, default=[1, 8])
    ap.add_argument("--contexts", type=int_list, default=[128, 512, 1000])
    ap.add_argument(
        "--queries",
        type=int_list,
        default=[1, 5],
        help="query rows per sequence (1 = decode, 5 = verify 4 drafts)",
    )
    ap.add_argument(
        "--prompts", type=int_list, default=[], help="prompt lengths: a fresh prompt's causal attention"
    )
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=30, help="caches used in turn (a model's layers)")
    ap.add_argument("--between-mb", type=float, default=4.0, help="memory streamed before each call (MB)")
    ap.add_argument("--baseline", help="git revision whose kernels to run side by side")
    ap.add_argument("--kv-dtypes", default="float32", help="cache dtypes to time, float32 first")
    ap.add_argument("--output", default="bench_results/attention_sweep.json")
    args = ap.parse_args()
    from verispec.kernels import build

    lib = build.load_qgemm()
    if lib is None:
        raise SystemExit("no kernels on this machine (VERISPEC_KERNELS=0, no compiler or no AVX2)")
    base = baseline_kernels(args.baseline, lib.isa) if args.baseline else None
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    print(
        f"CPU: {cpu_model()}; kernels={lib.isa} threads={torch.get_num_threads()} heads={hq}/{hkv} head_dim={d} layers={args.layers} "
        f"between={args.between_mb:g} MB (median us per layer call)"
    )
    between = int(args.between_mb * (1 << 20) / 4)
    # 256 MB of floats to stream from
    stream = torch.ones(max(64 * (1 << 20), 2 * between) if between else 1)
    extra = f" {args.baseline[:10] + ' us':>14} {'x':>6} {'equal':>6}" if base else ""
    narrow = [getattr(torch, n) for n in args.kv_dtypes.split(",") if n != "float32"]
    extra += "".join(f" {str(dt)[6:] + ' us':>13} {'x':>6}" for dt in narrow)
    print(f"{'batch':>5} {'queries':>7} {'context':>7} {'us':>9}{extra}")
    # (batch, query rows, context, causal prompt)
    shapes = [(s, nq, t, False) for s in args.batches for nq in args.queries for t in args.contexts] + [
        (1, n, n, True) for n in args.prompts
    ]
    rows = []
    for s, nq, t, prompt in shapes:
        g = torch.Generator().manual_seed(0)
        caches = [torch.randn(s, 2 * hkv, t + 1, d, generator=g) for _ in range(args.layers)]
        q = torch.randn(s, hq, nq, d, generator=g)
        out = torch.empty(s, nq, hq, d)
        mask = torch.ones(nq, t, dtype=torch.bool).tril(t - nq)[None, None] if prompt else None
        r = {"batch": s, "queries": nq, "context": t, "prompt": prompt}
        calls = [attention_call(lib, q, c, hkv, t, out, mask) for c in caches]
        r["s"] = median_call(calls, args.reps, stream, between)
        line = f"{s:>5} {nq:>7} {t:>7} {r['s'] * 1e6:>9.1f}"
        if base is not None:
            ref = torch.empty_like(out)
            calls = [attention_call(base, q, c, hkv, t, ref, mask) for c in caches]
            r["baseline_s"] = median_call(calls, args.reps, stream, between)
            # both wrote the last layer's output
            r["equal"] = torch.equal(out, ref)
            line += f" {r['baseline_s'] * 1e6:>14.1f} {r['baseline_s'] / r['s']:>5.2f}x {str(r['equal']):>6}"
        for dt in narrow:
            # the same keys stored narrower; the float32 call's time / this one's
            calls = [attention_call(lib, q, c.to(dt), hkv, t, torch.empty_like(out), mask) for c in caches]
            r[f"{str(dt)[6:]}_s"] = sec = median_call(calls, args.reps, stream, between)
            line += f" {sec * 1e6:>13.1f} {r['s'] / sec:>5.2f}x"
        rows.append(r)
        if prompt:
            line += "  (a prompt: causal)"
        print(line)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps(
            {
                "cpu": cpu_model(),
                "kernels": lib.isa,
                "baseline": args.baseline,
                "layers": args.layers,
                "between_mb": args.between_mb,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
