"""The CUDA path's attention over the paged KV cache: the Triton kernel reading the blocks in place through the block
table (today's path) against gathering each sequence's blocks into a contiguous copy first and running the same
kernel on it (the path before), by batch size and context length. Both must give bitwise the same output. A third
column times PyTorch's scaled_dot_product_attention on the gathered copy: what a kernel that is not batch-invariant
costs, for scale.

A decode step's shapes: one query row per sequence (plain decoding) or 5 (verifying 4 drafts), the blocks of each
sequence scattered over the pool as a long-running server leaves them. Prints the median microseconds per layer
call and writes JSON. On a machine without a GPU, --device cpu runs the kernel under Triton's interpreter (slow:
a smoke test of the script, not a timing).
    python3 benchmarks/cuda_attention.py [--heads 12,2,128] [--contexts 512,2048,8192] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from verispec.kernels import cuda_ops
from verispec.layers.attention import read_kv


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def make_case(s: int, nq: int, t: int, hq: int, hkv: int, d: int, bs: int, device: str, dtype: torch.dtype):
    """-> (q [S, Hq, Q, D], cache [blocks, 2Hkv, bs, D], block table rows [S, n], visible keys, mask [S, 1, Q, T]):
    each row of a sequence sees the keys up to its own position (the causal mask of a verification step)."""
    g = torch.Generator().manual_seed(s * 100003 + t)
    n = -(-t // bs)
    pool = s * n + 8
    cache = torch.randn(pool, 2 * hkv, bs, d, generator=g).to(device=device, dtype=dtype)
    blocks = torch.randperm(pool, generator=g)[: s * n].view(s, n).to(device)
    q = torch.randn(s, hq, nq, d, generator=g).to(device=device, dtype=dtype)
    pos = torch.arange(t, device=device)
    # [S, 1, Q, T]
    last = t - nq + torch.arange(nq, device=device)
    mask = (pos[None, :] <= last[:, None]).expand(s, 1, nq, t).contiguous()
    return q, cache, blocks, cuda_ops.visible_keys(mask, t, q.device), mask


def gather(cache, blocks, t: int, shift: int) -> torch.Tensor:
    """Each sequence's blocks copied out: [S, 2Hkv, T, D], by the PyTorch path's read_kv."""
    return read_kv(cache, SimpleNamespace(blocks=blocks, block_shift=shift, kv_len=t), cache.dtype)


def gathered(q, cache, blocks, visible, mask, t: int, hkv: int, shift: int):
    """The path before: the copy, then the kernel."""
    kv = gather(cache, blocks, t, shift)
    return cuda_ops.attention(q, kv[:, :hkv], kv[:, hkv:], 0.125, None, visible)


def in_place(q, cache, blocks, visible, mask, t: int, hkv: int, shift: int):
    return cuda_ops.attention(q, cache[:, :hkv], cache[:, hkv:], 0.125, None, visible, (blocks, shift))


def sdpa(q, cache, blocks, visible, mask, t: int, hkv: int, shift: int):
    """PyTorch's attention on the copy (not batch-invariant), for scale."""
    kv = gather(cache, blocks, t, shift)
    return F.scaled_dot_product_attention(
        q, kv[:, :hkv], kv[:, hkv:], attn_mask=mask, scale=0.125, enable_gqa=True
    )


def median_us(fn, call: tuple, reps: int, sync) -> float:
    fn(*call)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*call)
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (Triton's interpreter: a smoke test)")
    ap.add_argument(
        "--heads", default="12,2,128", help="query heads, KV heads, head dim (default: the 1.5B's)"
    )
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32])
    ap.add_argument("--contexts", type=int_list, default=[512, 2048, 8192])
    ap.add_argument("--rows", type=int_list, default=[1, 5], help="query rows per sequence")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--output", default="bench_results/cuda_attention.json")
    args = ap.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu runs Triton's interpreter: set TRITON_INTERPRET=1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; --device cpu with TRITON_INTERPRET=1 runs a smoke test")
    if not cuda_ops.HAVE_TRITON:
        raise SystemExit("needs Triton (pip install triton)")
    hq, hkv, d = int_list(args.heads)
    bs = args.block_size
    if bs & (bs - 1):
        raise SystemExit(f"--block-size must be a power of 2, got {bs}")
    shift = bs.bit_length() - 1
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (Triton interpreter)"
    print(f"{name}; heads {hq}/{hkv}, head dim {d}, block size {bs}, {dtype}; median us per layer call")
    head = f"{'batch':>5} {'rows':>4} {'context':>7} {'gathered':>10} {'in place':>10} {'speed-up':>8} {'sdpa':>10}"
    print(head, "equal")
    results = []
    with torch.inference_mode():
        for s in args.batches:
            for nq in args.rows:
                for t in args.contexts:
                    q, cache, blocks, visible, mask = make_case(s, nq, t, hq, hkv, d, bs, args.device, dtype)
                    call = (q, cache, blocks, visible, mask, t, hkv, shift)
                    equal = torch.equal(gathered(*call), in_place(*call))
                    before = median_us(gathered, call, args.reps, sync)
                    now = median_us(in_place, call, args.reps, sync)
                    torch_us = median_us(sdpa, call, args.reps, sync)
                    row = dict(
                        batch=s,
                        rows=nq,
                        context=t,
                        gathered_us=before,
                        in_place_us=now,
                        sdpa_us=torch_us,
                        equal=equal,
                    )
                    results.append(row)
                    cells = f"{before:>10.1f} {now:>10.1f} {before / now:>7.2f}x {torch_us:>10.1f}"
                    print(f"{s:>5} {nq:>4} {t:>7} {cells} {equal}")
    out = dict(device=name, heads=[hq, hkv, d], block_size=bs, dtype=str(dtype), results=results)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.output}")
    if not all(r["equal"] for r in results):
        raise SystemExit("the in-place kernel's output differs from the gathered one's")


if __name__ == "__main__":
    main()
