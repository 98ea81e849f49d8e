"""Random GGUF weight blocks for the kernel tests: gguf's quantizer where it has one, raw random blocks otherwise."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from verispec.kernels.qweight import QuantWeight

# the GGML types QuantWeight keeps quantized (verispec.kernels.qweight.GGUF_TYPES)
TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0", "Q6_K"]


def random_q4_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw Q4_K rows (gguf has no Q4_K quantizer): random 6-bit scales/mins and nibbles, float16 d and dmin."""
    raw = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    # d
    raw[..., 0:2] = np.float16(rng.uniform(0.001, 0.01)).reshape(1).view(np.uint8)
    # dmin
    raw[..., 2:4] = np.float16(rng.uniform(0.001, 0.01)).reshape(1).view(np.uint8)
    return raw.reshape(n, -1)


def make_weight(qtype: str, n: int, k: int, seed: int = 0) -> tuple[QuantWeight, torch.Tensor]:
    """A random [n, k] weight of GGML type `qtype` (k rounded up to whole super-blocks) -> (QuantWeight, its float32
    values as gguf.quants.dequantize gives them)."""
    rng = np.random.default_rng(seed)
    # the k-quants need whole 256-weight super-blocks
    k = -(-k // 256) * 256 if qtype in ("Q4_K", "Q6_K") else k
    if qtype == "Q4_K":
        raw = random_q4_k(n, k, rng)
    elif qtype == "Q6_K":
        raw = random_q6_k(n, k, rng)
    else:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[qtype])
    return QuantWeight.from_gguf(raw, qtype, (n, k)), torch.from_numpy(
        dequantize(raw, GGMLQuantizationType[qtype])
    )


def random_q6_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw Q6_K rows (gguf has no Q6_K quantizer): random 6-bit weights and int8 scales (-128 included), a float16
    d per 256-weight super-block."""
    raw = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
    # d
    raw[..., 208:210] = np.float16(rng.uniform(0.0005, 0.002)).reshape(1).view(np.uint8)
    return raw.reshape(n, -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) -> raw Q4_K rows (gguf has no Q4_K quantizer). Simpler than llama.cpp's
    search, the same format: per 32 weights a min m = max(0, -min x) and scale s = (max x + m) / 15, per 256
    float16 d = max(s) / 63 and dmin = max(m) / 63 and 6-bit sc = round(s / d), mn = round(m / dmin), q =
    clip(round((x + dmin mn) / (d sc)), 0, 15), packed as gguf's Q4_K.dequantize_blocks unpacks them."""
    n, k = x.shape
    ns = k // 256
    # [N, ns, sub-block, 32]
    b = x.astype(np.float32).reshape(n, ns, 8, 32)
    m = np.maximum(0, -b.min(-1))
    s = (b.max(-1) + m) / np.float32(15)
    d, dmin = ((v.max(-1, keepdims=True) / np.float32(63)).astype(np.float16) for v in (s, m))
    # [N, ns, 8] 6-bit integers
    sc, mn = (
        np.clip(np.rint(np.divide(v, h32, out=np.zeros_like(v), where=h32 > 0)), 0, 63).astype(np.uint8)
        for v, h32 in ((s, d.astype(np.float32)), (m, dmin.astype(np.float32)))
    )
    step = (d.astype(np.float32) * sc)[..., None]
    low = (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.rint(np.divide(b + low, step, out=np.zeros_like(b), where=step > 0)), 0, 15).astype(
        np.uint8
    )
    # scales: bytes 0-3 sc 0-3 (+ bits 4-5 of sc 4-7 on top), 4-7 mn likewise, 8-11 low nibbles of sc / mn 4-7
    packed = np.concatenate(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4),
        ],
        axis=-1,
    )
    # sub-blocks 2i and 2i + 1 share 32 bytes: low and high nibbles
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, ns, 128)
    parts = [d.view(np.uint8).reshape(n, ns, 2), dmin.view(np.uint8).reshape(n, ns, 2), packed, qs]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) -> raw Q6_K rows (gguf has no Q6_K quantizer). Simpler than llama.cpp's
    search for the best scales, but the same format: per 16 weights a scale s = max|x| / 31, per 256 a float16
    d = max(s) / 127 and int8 scales round(s / d), q = clip(round(x / (d * scale)), -32, 31), bit-packed as
    gguf's Q6_K.dequantize_blocks unpacks them."""
    n, k = x.shape
    ns = k // 256
    # [N, ns, sub-block, 16] in weight order
    b = x.astype(np.float32).reshape(n, ns, 16, 16)
    # [N, ns, 16]
    s = np.abs(b).max(-1) / np.float32(31)
    # [N, ns, 1]
    d = (s.max(-1, keepdims=True) / np.float32(127)).astype(np.float16)
    d32 = d.astype(np.float32)
    sc = np.clip(np.rint(np.divide(s, d32, out=np.zeros_like(s), where=d32 > 0)), 0, 127).astype(np.int8)
    # [N, ns, 16, 1]
    step = (d32 * sc)[..., None]
    q = np.clip(np.rint(np.divide(b, step, out=np.zeros_like(b), where=step > 0)), -32, 31)
    # weight 128 h + 32 t + l of a super-block: low nibble in ql byte 64 h + 32 (t % 2) + l (shift 4 (t // 2)),
    # high 2 bits in qh byte 32 h + l (shift 2 t)
    # [N, ns, h, t, l]
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(n, ns, 2, 4, 32)
    ql = np.zeros((n, ns, 2, 2, 32), np.uint8)
    qh = np.zeros((n, ns, 2, 32), np.uint8)
    for t in range(4):
        ql[:, :, :, t % 2] |= (u[:, :, :, t] & 0x0F) << np.uint8(4 * (t // 2))
        qh |= (u[:, :, :, t] >> np.uint8(4)) << np.uint8(2 * t)
    parts = [
        ql.reshape(n, ns, 128),
        qh.reshape(n, ns, 64),
        sc.view(np.uint8),
        d.view(np.uint8).reshape(n, ns, 2),
    ]
    return np.concatenate(parts, axis=-1).reshape(n, -1)
