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
    raw[..., 0:2] = np.float16(rng.uniform(0.001, 0.01)).reshape(1).view(np.uint8)  # d
    raw[..., 2:4] = np.float16(rng.uniform(0.001, 0.01)).reshape(1).view(np.uint8)  # dmin
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
    raw[..., 208:210] = np.float16(rng.uniform(0.0005, 0.002)).reshape(1).view(np.uint8)  # d
    return raw.reshape(n, -1)
