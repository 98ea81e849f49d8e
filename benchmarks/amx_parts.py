"""What one block product costs on the tile unit (AMX-INT8), part by part, against the int8 kernel itself.

The int8 kernels' contract (verispec/kernels/qgemm_i8.c) scales every 32-weight block on its own: per block, a
16-row x 16-column x 32-deep int32 product (`tdpbssd`), its C tile stored, and per row acc = fma(float(dot),
d_w * d_x, acc) then (q4) acc = fma(m_w, d_x * sum(q_x), acc). This script times those parts in a C loop with every
operand in L1 (one thread, ns per product, best of --reps runs taking turns), then the kernel on q4v weights at
--rows rows (ns per product over the same count), so that the kernel can be read against the floor its contract
leaves on this CPU:

    .venv/bin/python benchmarks/amx_parts.py [--rows 304] [--k 1536] [--n 8960] [--reps 7]

Needs a CPU with AMX-INT8, gcc and the kernel library; prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from adaptive_k import cpu_model

from verispec.kernels import build
from verispec.kernels.qweight import INT8_FMT_CODE

# One timing loop per part; `main` runs part argv[1] for argv[2] products and prints its seconds.
C_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; }
    __attribute__((packed)) TileConfig;
static int8_t A[64][512] __attribute__((aligned(64))), B[64][512] __attribute__((aligned(64)));
static int32_t C[4][256] __attribute__((aligned(64)));
static float xd[1024], xs[1024], dw[16], mw[16];
static __m512 acc[16];

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

// the q4 contract for one stored C tile: 16 rows of cvt, mul, fma, fma
static inline void scale(const int32_t *c, long i) {
    const __m512 d = _mm512_loadu_ps(dw), m = _mm512_loadu_ps(mw);
    const float *x = xd + (i * 16 & 1023), *s = xs + (i * 16 & 1023);
    for (int r = 0; r < 16; r++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r));
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(x[r])), acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(s[r]), acc[r]);
    }
}

#define LOADS(ta, tb, i) _tile_loadd(ta, A[(i) & 63], 32); _tile_loadd(tb, B[(i) & 63], 64)
#define FRESH(tc, ta, tb) _tile_zero(tc); _tile_dpbssd(tc, ta, tb)

int main(int argc, char **argv) {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 3;
    const int part = atoi(argv[1]);
    const long P = atol(argv[2]);
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; t++) c.rows[t] = 16, c.colsb[t] = 32;   // A: 16 rows x one 32-byte block
    for (int t = 2; t < 4; t++) c.rows[t] = 8, c.colsb[t] = 64;    // B: 8 rows of 16 columns x 4 bytes
    for (int t = 4; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;   // C: 16 x 16 int32
    _tile_loadconfig(&c);
    for (int i = 0; i < 1024; i++) xd[i] = xs[i] = 1e-6f;
    for (int i = 0; i < 16; i++) dw[i] = mw[i] = 1e-6f, acc[i] = _mm512_setzero_ps();
    memset(A, 1, sizeof A);
    memset(B, 1, sizeof B);
    const double t0 = now();
    for (long i = 0; i < P; i += 4) {
        switch (part) {
            case 0:  // the unit alone: four C tiles accumulating
                _tile_dpbssd(4, 0, 2); _tile_dpbssd(5, 1, 3); _tile_dpbssd(6, 0, 2); _tile_dpbssd(7, 1, 3);
                break;
            case 1:  // a fresh C tile per block
                FRESH(4, 0, 2); FRESH(5, 1, 3); FRESH(6, 0, 2); FRESH(7, 1, 3);
                break;
            case 2:  // + its A and B tiles loaded (from L1)
                LOADS(0, 2, i); FRESH(4, 0, 2); LOADS(1, 3, i + 1); FRESH(5, 1, 3);
                LOADS(0, 2, i + 2); FRESH(6, 0, 2); LOADS(1, 3, i + 3); FRESH(7, 1, 3);
                break;
            case 3:  // + its C tile stored
                LOADS(0, 2, i); FRESH(4, 0, 2); _tile_stored(6, C[2], 64);
                LOADS(1, 3, i + 1); FRESH(5, 1, 3); _tile_stored(7, C[3], 64);
                LOADS(0, 2, i + 2); FRESH(6, 0, 2); _tile_stored(4, C[0], 64);
                LOADS(1, 3, i + 3); FRESH(7, 1, 3); _tile_stored(5, C[1], 64);
                break;
            case 4:  // the scaling alone, from a stored C tile in L1
                scale(C[0], i); scale(C[1], i + 1); scale(C[2], i + 2); scale(C[3], i + 3);
                __asm__ volatile("" ::: "memory");
                break;
            case 6:  // the same, scaling the tile stored three products before
                LOADS(0, 2, i); FRESH(4, 0, 2); _tile_stored(6, C[2], 64); scale(C[3], i);
                LOADS(1, 3, i + 1); FRESH(5, 1, 3); _tile_stored(7, C[3], 64); scale(C[0], i + 1);
                LOADS(0, 2, i + 2); FRESH(6, 0, 2); _tile_stored(4, C[0], 64); scale(C[1], i + 2);
                LOADS(1, 3, i + 3); FRESH(7, 1, 3); _tile_stored(5, C[1], 64); scale(C[2], i + 3);
                break;
            default:  // all of it: loads, product, store, and the scaling of the tile stored a product before
                LOADS(0, 2, i); FRESH(4, 0, 2); _tile_stored(6, C[2], 64); scale(C[1], i);
                LOADS(1, 3, i + 1); FRESH(5, 1, 3); _tile_stored(7, C[3], 64); scale(C[2], i + 1);
                LOADS(0, 2, i + 2); FRESH(6, 0, 2); _tile_stored(4, C[0], 64); scale(C[3], i + 2);
                LOADS(1, 3, i + 3); FRESH(7, 1, 3); _tile_stored(5, C[1], 64); scale(C[0], i + 3);
                break;
        }
    }
    const double t = now() - t0;
    float sink = 0;
    for (int r = 0; r < 16; r++) sink += _mm512_reduce_add_ps(acc[r]);
    _tile_release();
    printf("%.9f %g\n", t, sink);
    return 0;
}
"""

PARTS = [
    "tdpbssd alone (4 C tiles accumulating)",
    "tdpbssd on a zeroed C tile",
    "+ A and B tile loads (L1)",
    "+ C tile store",
    "per-block scaling alone (16 rows)",
    "loads + product + store + scaling",
    "the same, scaling 3 products behind",
]
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mamx-tile", "-mamx-int8"]


def q4v_weights(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random q4v bytes (qgemm_i8.c's layout): per column group and block 384 bytes, float d [16] and m [16] first
    (small positive floats), then 256 bytes of nibbles."""
    blocks = n // 16 * (k // 32)
    w = rng.integers(0, 256, size=(blocks, 384), dtype=np.uint8)
    w[:, :128] = rng.uniform(1e-3, 1e-1, size=(blocks, 32)).astype(np.float32).view(np.uint8)
    return w


def kernel_ns(rows: int, k: int, n: int, reps: int) -> float:
    """verispec's AMX-INT8 kernel on q4v weights, one thread: best ns per 16 x 16 x 32 product."""
    amx = build.INT8_ISAS["amx-int8"][0]
    lib = build.load_qgemm()
    if (
        lib is None
        or not hasattr(lib, "qgemm_i8")
        or not (lib.qgemm_i8_isas() >> amx & 1)
        or not lib.i8_amx_init()
    ):
        raise SystemExit("the kernel library has no AMX-INT8 variant on this CPU")
    rng = np.random.default_rng(0)
    w = q4v_weights(n, k, rng)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    y = np.empty((rows, n), dtype=np.float32)
    ptr = ctypes.c_void_p
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        lib.qgemm_i8(
            amx,
            INT8_FMT_CODE["q4v"],
            ptr(x.ctypes.data),
            rows,
            k,
            ptr(w.ctypes.data),
            n,
            ptr(y.ctypes.data),
            1,
        )
        best = min(best, time.perf_counter() - t)
    products = -(-rows // 16) * (k // 32) * (n // 16)
    return best / products * 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=304)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--n", type=int, default=8960)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--products", type=int, default=2_000_000)
    ap.add_argument("--output", default="bench_results/amx_parts.json")
    args = ap.parse_args()
    if not build.INT8_ISAS["amx-int8"][1] <= build._cpu_flags():
        print("this CPU has no AMX-INT8", file=sys.stderr)
        raise SystemExit(2)
    cpu = cpu_model()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "parts.c", Path(tmp) / "parts"
        src.write_text(C_SOURCE)
        subprocess.run(["gcc", *FLAGS, "-o", str(exe), str(src)], check=True)
        best = [float("inf")] * len(PARTS)
        for rep in range(args.reps):
            # the parts take turns, in another order each round, so a busy spell of a shared VM falls on all alike
            for p in random.Random(rep).sample(range(len(PARTS)), len(PARTS)):
                out = subprocess.run([str(exe), str(p), str(args.products)], capture_output=True, text=True)
                if out.returncode != 0:
                    print(
                        f"part {p} failed (exit {out.returncode}): the OS grants no tile state?",
                        file=sys.stderr,
                    )
                    raise SystemExit(2)
                best[p] = min(best[p], float(out.stdout.split()[0]) / args.products * 1e9)
    kern = kernel_ns(args.rows, args.k, args.n, args.reps)
    print(f"{cpu}, one thread, ns per 16 x 16 x 32 int8 block product (8,192 multiply-adds):")
    for name, ns in zip(PARTS, best):
        print(f"  {name:<40} {ns:7.1f} ns  {8192 / ns:7.1f} GMAC/s")
    print(
        f"  {'kernel, q4v ' + f'{args.rows} x {args.k} x {args.n}':<40} {kern:7.1f} ns  {8192 / kern:7.1f} GMAC/s"
    )
    print(f"kernel / its parts with operands in L1: {kern / best[5]:.2f}x")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps(
            {
                "cpu": cpu,
                "rows": args.rows,
                "k": args.k,
                "n": args.n,
                "parts_ns": dict(zip(PARTS, best)),
                "kernel_ns": kern,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
