"""QuantWeight: a [N, K] weight kept in 32-weight quantized blocks, and its product with float32 activations.

GGUF's Q4_0 / Q4_1 / Q4_K / Q5_0 / Q8_0 / Q6_K rows are repacked (once, at load time) into the three layouts
qgemm.c reads (Q4_K's 32-weight sub-blocks become q4 blocks, Q5_0's 5-bit weights q8 blocks, Q6_K's 6-bit weights
with one scale per 16 q6 blocks):
  q4: float32 d, float32 m, 2 x uint64 (24 bytes); uint64 h holds weights 16h..16h+15, the even ones in its low
      32 bits (nibble t = weight 16h+2t), the odd ones in its high 32 bits (nibble t = weight 16h+2t+1)
  q8: float32 d, 32 x int8 (36 bytes)
  q6: float32 d0, float32 d1, 32 x int8 q in -32..31 (40 bytes); weight j = d_(j / 16) * q[j] (Q6_K's d * scale
      of each 16-weight sub-block, exact in float32: an 11-bit float16 times an 8-bit integer)
  q4t / q8t: q4 / q8 regrouped for the AMX build (qgemm_amx.c), per 16 output columns and block: q4t (384 bytes) =
      float32 d[16], float32 m[16], one nibble plane (4 x 32 uint16 words whose nibbles are the block's bfloat16
      B tile); q8t (576 bytes) = float32 d[16], the 512 int8 weights in B-tile order. `tiled()` makes them once
      the rows are final (N must be a multiple of 16).
  q4v / q8v: the layouts of the int8-activation kernels (qgemm_i8.c), per 16 output columns and block: q4v (384
      bytes) = float32 d[16], float32 m[16], 4 rows of 64 bytes (column n: bytes 4n..4n+3 hold weights k = 4j..4j+3
      of row j in their low nibbles, k = 16+4j.. in their high ones); q8v (576 bytes) = float32 d[16], 8 such rows
      of uint8 q + 128; q6v (640 bytes) = float32 d0[16], float32 d1[16], 8 such rows of uint8 q + 32 (rows 0-3:
      weights 0-15, scaled by d0; rows 4-7: weights 16-31, by d1). `for_int8()` makes them (N a multiple of 16).
  q4kv / q6kv: q4v / q6v for Q4_K / Q6_K weights (K a multiple of 256) with their scales factored back into a
      float16 per super-block times integers (exact: the same floats), per 16 columns and super-block a 320-byte
      record, then the 8 blocks' rows (q6kv: 6-bit codes as a nibble plane and a 2-bit plane). Layouts:
      qgemm_i8.c's header. 4.6 / 6.6 bits a weight against 6 / 10 (AMX-INT8 expands them into its tiles).
  q5v: q8v for Q5_0 weights (q in -16..15, float16 d; K a multiple of 64): per 16 columns and pair of blocks,
      nibble rows, a plane of 5th bits and float16 d (qgemm_i8.c's header), 5.5 bits a weight against 9.
  q6 has no AMX-BF16 layout: the 'amx' build multiplies it with qgemm.c's AVX-512 code.
Every weight dequantizes to exactly the float32 value `gguf.quants.dequantize` gives for the original block.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch

from verispec.kernels.build import INT8_ISAS, int8_isa, load_qgemm

QK = 32
# q4t / q8t / q4v / q8v: per (column, block) on average
BLOCK_BYTES = {"q4": 24, "q8": 36, "q6": 40, "q4t": 24, "q8t": 36, "q4v": 24, "q8v": 36, "q6v": 40}
TILED = {"q4": "q4t", "q8": "q8t"}
INT8 = {"q4": "q4v", "q8": "q8v", "q6": "q6v"}
# the compact int8-activation layouts: q4 / q6 weights whose scales factor
# (Q4_K's / Q6_K's), q8 weights whose q fit 5 bits with float16 scales (Q5_0's)
COMPACT = {"q4": "q4kv", "q6": "q6kv", "q8": "q5v"}
INT8_FMT_CODE = {"q4v": 0, "q8v": 1, "q6v": 2, "q4kv": 3, "q6kv": 4, "q5v": 5}
# q4t / q8t: output columns per AMX tile
GROUP = 16
# GGML type names this module repacks
GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0", "Q6_K")
# K must be a multiple of this (default: QK)
SUPER_BLOCK = {"Q4_K": 256, "Q6_K": 256}
# the kernel library's repacking (repack.c) of these types, and the layout it writes
_C_REPACK = {"Q4_K": ("repack_q4k", "q4"), "Q6_K": ("repack_q6k", "q6")}
_C_DEQUANT = {"q4": 0, "q8": 1, "q6": 2}
# bytes per group of 16 columns and block of 32 in the int8-activation layouts (qgemm_i8.c; q4kv / q6kv: on average)
INT8_BLOCK_BYTES = {"q4": 384, "q8": 576, "q6": 640, "q4kv": 296, "q6kv": 424, "q5v": 352}
# q4kv / q6kv: bytes per group and super-block of 256, and of the scale record that starts it
SUPER_RECORD = {"q4kv": (2368, 320), "q6kv": (3392, 320)}
# weights per record of the compact layouts (K must be a multiple)
RECORD_K = {"q4kv": 256, "q6kv": 256, "q5v": 64}


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 little-endian float16 -> [..., 1] float32."""
    return b.copy().view(np.float16).astype(np.float32)


def _q4_k_blocks(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [N, ns, 144] -> (d, m, qs) of their 32-weight sub-blocks, [N, ns*8, 1 / 1 / 16].

    Sub-block j: weight = (d * sc_j) * q - dmin * m_j, where both products are exact in float32 (11-bit float16
    times a 6-bit integer), so d' = d * sc_j and m' = -(dmin * m_j) give d' * q + m' with the one rounding gguf's
    dequantize does."""
    n, ns = b.shape[:2]
    # [N, ns, 1]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    # 8 six-bit scales and mins per super-block, unpacked as gguf's Q4_K.get_scale_min does: [N, ns, 8] each
    sc6 = b[..., 4:16].reshape(n, ns, 3, 4)
    lo, hi, mix = sc6[..., 0, :], sc6[..., 1, :], sc6[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1).astype(np.float32)
    # [N, ns*8, 1]
    dj, mj = (d * sc).reshape(n, -1, 1), (-(dmin * mn)).reshape(n, -1, 1)
    shifts = np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    # [N, ns, 4, 2, 32]: 64 weights = low, high nibbles
    q = b[..., 16:].reshape(n, ns, 4, 1, 32) >> shifts
    # [N, ns*8, 32] weight order
    q = (q & 0x0F).reshape(n, -1, QK)
    # GGUF Q4_0 byte order: weight j low, weight 16 + j high
    return dj, mj, q[..., :16] | (q[..., 16:] << 4)


def _q6_k_blocks(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks [N, ns, 210] (ql [128], qh [64], int8 scales [16], float16 d) -> d * scale of each
    16-weight sub-block [N, ns*8, 2] float32 (exact) and q [N, ns*8, 32] int8 in -32..31, in weight order (the
    unpacking of gguf's Q6_K.dequantize_blocks)."""
    n, ns = b.shape[:2]
    # [N, ns, 1]
    d = _f16(b[..., 208:210])
    # [N, ns*8, 2]
    ds = (d * b[..., 192:208].copy().view(np.int8).astype(np.float32)).reshape(n, -1, 2)
    ql = b[..., :128].reshape(n, ns, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    # [N, ns, 8, 32]: 32-weight block c = 4 * half + 2 * shift + byte // 32
    ql = (ql & 0x0F).reshape(
        n,
        ns,
        8,
        32,
    )
    qh = b[..., 128:192].reshape(n, ns, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    qh = (qh & 0x03).reshape(n, ns, 8, 32)
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    return ds, q.reshape(n, -1, QK)


def _to_groups(a: np.ndarray) -> np.ndarray:
    """[N, nb, 1] per-(column, block) values -> [G, nb, 16]: the 16 columns of a group side by side."""
    n, nb = a.shape[:2]
    return np.ascontiguousarray(a.reshape(n // GROUP, GROUP, nb).transpose(0, 2, 1))


def _from_groups(a: np.ndarray, n: int) -> np.ndarray:
    """[G, nb, 16] -> [N, nb, 1] (inverse of _to_groups)."""
    return np.ascontiguousarray(a.transpose(0, 2, 1).reshape(n, -1, 1))


def _to_plane(q: np.ndarray) -> np.ndarray:
    """q [N, nb, 32] values 0..15 in weight order -> nibble planes [G, nb, 4, 32] uint16 (layout: qgemm_amx.c).

    Word j of chunk c holds in nibble t the weight of B-tile row r = 4t + c, word j: column j // 2, k = 2r + j % 2."""
    n, nb = q.shape[:2]
    # [G, nb, r, n, pair]
    rows = q.reshape(n // GROUP, GROUP, nb, 16, 2).transpose(0, 2, 3, 1, 4)
    # r = 4t + c: [G, nb, t, c, j]
    rows = rows.reshape(n // GROUP, nb, 4, 4, 32).astype(np.uint16)
    return (rows << (4 * np.arange(4, dtype=np.uint16)).reshape(4, 1, 1)).sum(axis=2, dtype=np.uint16)


def _from_plane(b: np.ndarray, n: int) -> np.ndarray:
    """[G, nb, 256] uint8 plane bytes -> q [N, nb, 32] uint8 (inverse of _to_plane)."""
    g, nb = b.shape[:2]
    # [G, nb, c, j]
    words = b.copy().view(np.uint16).reshape(g, nb, 4, 32)
    # [G, nb, t, c, j]
    rows = (words[:, :, None] >> (4 * np.arange(4, dtype=np.uint16)).reshape(4, 1, 1)) & 15
    # [G, nb, r, n, pair]
    rows = rows.reshape(g, nb, 16, GROUP, 2)
    # k = 2r + pair
    return rows.transpose(0, 3, 1, 2, 4).reshape(n, nb, QK).astype(np.uint8)


def _to_quads(q: np.ndarray) -> np.ndarray:
    """q [N, nb, 32] in weight order -> [G, nb, 8, 64]: row j, bytes 4n..4n+3 = weights 4j..4j+3 of column n."""
    n, nb = q.shape[:2]
    # [G, nb, j, n, i]
    rows = q.reshape(n // GROUP, GROUP, nb, 8, 4).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(rows.reshape(n // GROUP, nb, 8, 64))


def _from_quads(rows: np.ndarray, n: int) -> np.ndarray:
    """[G, nb, 8, 64] -> q [N, nb, 32] in weight order (inverse of _to_quads)."""
    g, nb = rows.shape[:2]
    # [G, n, nb, j, i]
    q = rows.reshape(g, nb, 8, GROUP, 4).transpose(0, 3, 1, 2, 4)
    return np.ascontiguousarray(q.reshape(n, nb, QK))


@dataclass
class QuantWeight:
    # "q4" | "q8" | "q6" | "q4t" | "q8t" | "q4v" | "q8v" | "q6v" | "q4kv" | "q6kv" | "q5v"
    fmt: str
    # [N, K/32 * BLOCK_BYTES[fmt]] uint8, C-contiguous
    blocks: np.ndarray
    # (N, K) = (out_features, in_features)
    shape: tuple[int, int]
    _ptr: int = field(init=False, repr=False, default=0)

    def __post_init__(self) -> None:
        # blocks never change: resolve the address once, not per call
        self._ptr = self.blocks.ctypes.data

    @staticmethod
    def supported(ggml_type: str, shape: tuple[int, ...]) -> bool:
        return ggml_type in GGUF_TYPES and len(shape) == 2 and shape[1] % SUPER_BLOCK.get(ggml_type, QK) == 0

    @classmethod
    def from_gguf(cls, raw: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> QuantWeight:
        """raw: [N, K / block * GGUF block bytes] uint8 rows of a tensor of one of GGUF_TYPES."""
        n, k = shape
        if ggml_type == "Q8_0":
            b = raw.reshape(n, k // QK, 34)
            return cls._q8(_f16(b[..., 0:2]), b[..., 2:].view(np.int8), shape)
        # d * (q - 16) with 5-bit q: an int8 block with the same d
        if ggml_type == "Q5_0":
            b = raw.reshape(n, k // QK, 22)
            # [N, nb, 1]: bit j = high bit of weight j
            qh = b[..., 2:6].copy().view(np.uint32)
            # [N, nb, 32]
            high = ((qh >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)
            # weight order
            q = np.concatenate([b[..., 6:] & 0x0F, b[..., 6:] >> 4], axis=-1) | (high << 4)
            return cls._q8(_f16(b[..., 0:2]), q.astype(np.int8) - np.int8(16), shape)
        if ggml_type == "Q4_0":
            b = raw.reshape(n, k // QK, 18)
            d = _f16(b[..., 0:2])
            # d*(q-8) == d*q + (-8d), both exact
            return cls._q4(d, d * np.float32(-8.0), b[..., 2:], shape)
        if ggml_type == "Q4_1":
            b = raw.reshape(n, k // QK, 20)
            return cls._q4(_f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:], shape)
        if ggml_type in _C_REPACK and load_qgemm() is not None:
            name, fmt = _C_REPACK[ggml_type]
            out = np.empty((n, k // QK * BLOCK_BYTES[fmt]), dtype=np.uint8)
            raw = np.ascontiguousarray(raw)
            getattr(load_qgemm(), name)(
                raw.ctypes.data, n, k // 256, out.ctypes.data, torch.get_num_threads()
            )
            return cls(fmt, out, shape)
        if ggml_type == "Q4_K":
            return cls._q4(*_q4_k_blocks(raw.reshape(n, k // 256, 144)), shape)
        if ggml_type == "Q6_K":
            return cls._q6(*_q6_k_blocks(raw.reshape(n, k // 256, 210)), shape)
        raise ValueError(f"cannot repack GGML type {ggml_type}; supported: {', '.join(GGUF_TYPES)}")

    @classmethod
    def quantize_q8(cls, w: torch.Tensor) -> QuantWeight:
        """float [N, K] (K a multiple of 32) -> Q8_0 blocks as llama.cpp's (and gguf's) quantizer makes them: per
        32 weights d = max |w| / 127, q = w / d rounded half away from zero, d stored as a float16."""
        n, k = w.shape
        a = w.detach().float().cpu().numpy().reshape(n, k // QK, QK)
        # [N, nb, 1]
        d = np.abs(a).max(-1, keepdims=True) / np.float32(127)
        x = a * np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
        # [N, nb, 32], |q| <= 127
        q = (np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))).astype(np.int8)
        return cls._q8(d.astype(np.float16).astype(np.float32), q, (n, k))

    @classmethod
    def _q8(cls, d: np.ndarray, q: np.ndarray, shape: tuple[int, int]) -> QuantWeight:
        """d [N, nb, 1] float32, q [N, nb, 32] int8 in weight order -> the q8 layout."""
        out = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1)
        return cls("q8", np.ascontiguousarray(out.reshape(shape[0], -1)), shape)

    @classmethod
    def _q6(cls, ds: np.ndarray, q: np.ndarray, shape: tuple[int, int]) -> QuantWeight:
        """ds [N, nb, 2] float32 (the scales of weights 0-15 and 16-31), q [N, nb, 32] int8 in weight order -> q6."""
        out = np.concatenate([ds.view(np.uint8), q.view(np.uint8)], axis=-1)
        return cls("q6", np.ascontiguousarray(out.reshape(shape[0], -1)), shape)

    @classmethod
    def _q4(cls, d: np.ndarray, m: np.ndarray, qs: np.ndarray, shape: tuple[int, int]) -> QuantWeight:
        """d, m [N, nb, 1] float32 (weight = d * q + m); qs [N, nb, 16] in GGUF's Q4_0 byte order -> the q4 layout."""
        n = shape[0]
        # GGUF byte j holds weight j (low nibble) and weight 16 + j (high nibble): half h of the block is the low
        # (h=0) or high (h=1) nibbles of bytes 0..15; its even weights are bytes 0, 2, .., its odd ones 1, 3, ..
        # Packing two nibbles per byte (t even low, t odd high) makes each group of 4 bytes one little-endian u32.
        halves = []
        # [N, nb, 16] uint8, weight 16h + j
        for nib in (qs & 0x0F, qs >> 4):
            # [N, nb, 8] nibble t = weight 16h + 2t + parity
            for par in (nib[..., 0::2], nib[..., 1::2]):
                # [N, nb, 4] = one u32
                halves.append(par[..., 0::2] | (par[..., 1::2] << 4))
        # [N, nb, 16] bytes: lo0, hi0, lo1, hi1
        words = np.concatenate(halves, axis=-1)
        out = np.concatenate([d.view(np.uint8), m.view(np.uint8), words], axis=-1)
        return cls("q4", np.ascontiguousarray(out.reshape(n, -1)), shape)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def _super_records(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q4kv / q6kv -> their super-block records [G, nsb, 320], float16 d [G, nb / 8, 16] and the blocks' bytes
        [G, nb, bytes per block]."""
        n, k = self.shape
        sb, rec = SUPER_RECORD[self.fmt]
        b = self.blocks.reshape(n // GROUP, k // 256, sb)
        d = b[..., :32].copy().view(np.float16).astype(np.float32)
        return b[..., :rec], d, b[..., rec:].reshape(n // GROUP, k // QK, (sb - rec) // 8)

    def _q4_parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q4 / q4t / q4v / q4kv -> d, m [N, nb, 1] float32 and q [N, nb, 32] uint8 in weight order (weight = d * q
        + m)."""
        n, k = self.shape
        nb = k // QK
        if self.fmt == "q4kv":
            rec, d16, blk = self._super_records()
            m16 = rec[..., 32:64].copy().view(np.float16).astype(np.float32)
            # [G, nb, 16]: float16 x integer, exact
            sc, mn = (
                rec[..., o : o + 128].reshape(n // GROUP, -1, 8, 16).astype(np.float32) for o in (64, 192)
            )
            d, m = ((h[:, :, None] * i).reshape(n // GROUP, nb, GROUP) for h, i in ((d16, sc), (m16, mn)))
            plane = blk.reshape(n // GROUP, nb, 4, 64)
            rows = _from_quads(np.concatenate([plane & 0x0F, plane >> 4], axis=2), n)
            return _from_groups(d, n), _from_groups(m, n), rows
        if self.fmt == "q4t":
            b = self.blocks.reshape(n // GROUP, nb, 384)
            d, m = (_from_groups(b[..., o : o + 64].copy().view(np.float32), n) for o in (0, 64))
            return d, m, _from_plane(b[..., 128:], n)
        if self.fmt == "q4v":
            b = self.blocks.reshape(n // GROUP, nb, 384)
            d, m = (_from_groups(b[..., o : o + 64].copy().view(np.float32), n) for o in (0, 64))
            plane = b[..., 128:].reshape(n // GROUP, nb, 4, 64)
            return d, m, _from_quads(np.concatenate([plane & 0x0F, plane >> 4], axis=2), n)
        b = self.blocks.reshape(n, nb, BLOCK_BYTES["q4"])
        # [N, nb, 1]
        d = b[..., 0:4].copy().view(np.float32)
        m = b[..., 4:8].copy().view(np.float32)
        # [N, nb, h, parity]
        words = b[..., 8:].copy().view(np.uint32).reshape(n, nb, 2, 2)
        # [N, nb, h, parity, t]
        q = (words[..., None] >> np.arange(0, 32, 4, dtype=np.uint32)) & np.uint32(15)
        # weight order 16h + 2t + parity
        q = q.swapaxes(-1, -2).reshape(n, nb, QK).astype(np.uint8)
        return d, m, q

    def _q8_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """q8 / q8t / q8v / q5v -> d [N, nb, 1] float32 and q [N, nb, 32] int8 in weight order (weight = d * q)."""
        n, k = self.shape
        nb = k // QK
        if self.fmt == "q5v":
            b = self.blocks.reshape(n // GROUP, nb // 2, 704)
            # [G, nb, 16] float16 d, [G, nb, 4, 64] nibbles, [G, nb, 64] 5th bits
            d = b[..., 640:].copy().view(np.float16).astype(np.float32).reshape(n // GROUP, nb, GROUP)
            nib = b[..., :512].reshape(n // GROUP, nb, 4, 64)
            bits = b[..., 512:640].reshape(n // GROUP, nb, 1, 64)
            j = np.arange(4, dtype=np.uint8)[:, None]
            rows = [(nib & 0x0F) | (((bits >> j) & 1) << 4), (nib >> 4) | (((bits >> (j + 4)) & 1) << 4)]
            q = _from_quads(np.concatenate(rows, axis=2), n).astype(np.int8) - np.int8(16)
            return _from_groups(d, n), q
        if self.fmt == "q8v":
            b = self.blocks.reshape(n // GROUP, nb, 576)
            q = _from_quads(b[..., 64:].reshape(n // GROUP, nb, 8, 64) ^ np.uint8(0x80), n).view(np.int8)
            return _from_groups(b[..., 0:64].copy().view(np.float32), n), q
        if self.fmt == "q8t":
            b = self.blocks.reshape(n // GROUP, nb, 576)
            # [G, nb, r, n, pair]: k = 2r + pair
            rows = b[..., 64:].reshape(n // GROUP, nb, 16, GROUP, 2)
            q = rows.transpose(0, 3, 1, 2, 4).reshape(n, nb, QK).view(np.int8)
            return _from_groups(b[..., 0:64].copy().view(np.float32), n), q
        b = self.blocks.reshape(n, nb, BLOCK_BYTES["q8"])
        return b[..., 0:4].copy().view(np.float32), b[..., 4:].view(np.int8)

    def _q6_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """q6 / q6v / q6kv -> ds [N, nb, 2] float32 and q [N, nb, 32] int8 in weight order (weight j = ds[j // 16] *
        q[j])."""
        n, k = self.shape
        nb = k // QK
        if self.fmt == "q6kv":
            rec, d16, blk = self._super_records()
            # [G, nsb, 16 halves, 16 columns] -> [G, nb, 2, 16]
            sc = rec[..., 32:288].copy().view(np.int8).reshape(n // GROUP, -1, 16, GROUP).astype(np.float32)
            ds = (d16[:, :, None] * sc).reshape(n // GROUP, nb, 2, GROUP)
            nib, high = (
                blk[..., :256].reshape(n // GROUP, nb, 4, 64),
                blk[..., 256:].reshape(n // GROUP, nb, 2, 64),
            )
            # rows 0-3 and 4-7: [G, nb, 8, 64] codes q + 32
            rows = [
                (half_nib & 0x0F)
                | (((high[:, :, h, None] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3) << 4)
                for h, half_nib in enumerate((nib, nib >> 4))
            ]
            q = _from_quads(np.concatenate(rows, axis=2), n).astype(np.int8) - np.int8(32)
            return np.concatenate([_from_groups(ds[:, :, h], n) for h in (0, 1)], -1), q
        if self.fmt == "q6v":
            b = self.blocks.reshape(n // GROUP, nb, 640)
            ds = np.concatenate(
                [_from_groups(b[..., o : o + 64].copy().view(np.float32), n) for o in (0, 64)], -1
            )
            q = _from_quads(b[..., 128:].reshape(n // GROUP, nb, 8, 64), n).astype(np.int8) - np.int8(32)
            return ds, q
        b = self.blocks.reshape(n, nb, BLOCK_BYTES["q6"])
        return b[..., 0:8].copy().view(np.float32), b[..., 8:].view(np.int8)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, exactly the values the kernel multiplies with."""
        n, k = self.shape
        lib = load_qgemm()
        if lib is not None and self.fmt in _C_DEQUANT:
            out = torch.empty(n, k, dtype=torch.float32)
            lib.dequant_rows(
                _C_DEQUANT[self.fmt], self._ptr, n, k // QK, out.data_ptr(), torch.get_num_threads()
            )
            return out
        if self.fmt in ("q6", "q6v", "q6kv"):
            ds, q = self._q6_parts()
            # [N, nb, 32]
            w = np.repeat(ds, 16, axis=-1) * q.astype(np.float32)
            return torch.from_numpy(np.ascontiguousarray(w.reshape(n, k)))
        if self.fmt in ("q8", "q8t", "q8v", "q5v"):
            d, q = self._q8_parts()
            return torch.from_numpy((q.astype(np.float32) * d).reshape(n, k))
        d, m, q = self._q4_parts()
        w = d * q.astype(np.float32) + m
        return torch.from_numpy(np.ascontiguousarray(w.reshape(n, k)))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [M] int64 -> rows [M, K] float32, dequantized (an embedding lookup; q4 / q8 / q6 layouts, on the
        kernel library), the values `dequantize()[ids]` gives."""
        n, k = self.shape
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), k, dtype=torch.float32)
        lib = load_qgemm()
        bad = lib.dequant_gather(
            _C_DEQUANT[self.fmt], self._ptr, n, k // QK, ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        if bad >= 0:
            raise IndexError(f"token id {int(ids[bad])} outside [0, {n})")
        return out

    def tiled(self) -> QuantWeight:
        """This weight in the q4t / q8t layout of the AMX kernel (the same weights); itself if it cannot be tiled."""
        n, k = self.shape
        if self.fmt not in TILED or n % GROUP:
            return self
        g, nb = n // GROUP, k // QK
        lib = load_qgemm()
        if lib is not None:
            out = np.empty_like(self.blocks)
            getattr(lib, f"tile_{self.fmt}")(self._ptr, n, nb, out.ctypes.data, torch.get_num_threads())
            return QuantWeight(TILED[self.fmt], out, self.shape)
        if self.fmt == "q4":
            d, m, q = self._q4_parts()
            parts = [_to_groups(d), _to_groups(m), _to_plane(q)]
        else:
            d, q = self._q8_parts()
            # [G, nb, r, n, pair]
            rows = q.view(np.uint8).reshape(g, GROUP, nb, 16, 2).transpose(0, 2, 3, 1, 4)
            parts = [_to_groups(d), np.ascontiguousarray(rows)]
        out = np.concatenate([p.reshape(g, nb, -1).view(np.uint8) for p in parts], axis=-1)
        return QuantWeight(TILED[self.fmt], np.ascontiguousarray(out.reshape(n, -1)), self.shape)

    def for_int8(self, native: bool = True, compact: bool = True) -> QuantWeight | None:
        """This weight in a layout of the int8-activation kernels (the same weights): q4kv / q6kv where it came from
        Q4_K / Q6_K, q5v where from Q5_0 (compact=False: never), else q4v / q8v / q6v; None if its shape
        does not allow it (N not a multiple of 16). From q4 / q8 / q6 in C where the kernel library is loaded
        (native=False: numpy, the reference the C conversion is tested against; no compact layout)."""
        n, k = self.shape
        if self.fmt in INT8_FMT_CODE:
            return self
        if n % GROUP:
            return None
        g, nb = n // GROUP, k // QK
        lib = load_qgemm()
        if compact and native and lib is not None:
            # the AMX build's float32 tiles (q4t / q8t) back to the file's blocks first: the compact layouts need them
            packed = (self.untiled() if self.fmt in TILED.values() else self).to_compact(lib)
            if packed is not None:
                return packed
        if native and self.fmt in _C_DEQUANT and lib is not None and hasattr(lib, "int8_layout"):
            out = np.empty((n, nb * INT8_BLOCK_BYTES[self.fmt] // GROUP), dtype=np.uint8)
            src = np.ascontiguousarray(self.blocks)
            lib.int8_layout(
                _C_DEQUANT[self.fmt], src.ctypes.data, n, nb, out.ctypes.data, torch.get_num_threads()
            )
            return QuantWeight(INT8[self.fmt[:2]], out, self.shape)
        if self.fmt in ("q4", "q4t"):
            d, m, q = self._q4_parts()
            # [G, nb, 8, 64]
            rows = _to_quads(q)
            parts = [_to_groups(d), _to_groups(m), rows[:, :, :4] | (rows[:, :, 4:] << 4)]
        elif self.fmt == "q6":
            ds, q = self._q6_parts()
            parts = [
                _to_groups(ds[..., :1]),
                _to_groups(ds[..., 1:]),
                _to_quads((q + np.int8(32)).view(np.uint8)),
            ]
        else:
            d, q = self._q8_parts()
            parts = [_to_groups(d), _to_quads(q.view(np.uint8) ^ np.uint8(0x80))]
        out = np.concatenate([p.reshape(g, nb, -1).view(np.uint8) for p in parts], axis=-1)
        return QuantWeight(INT8[self.fmt[:2]], np.ascontiguousarray(out.reshape(n, -1)), self.shape)

    def to_compact(self, lib: ctypes.CDLL | None = None) -> QuantWeight | None:
        """q4 / q6 -> q4kv / q6kv, q8 -> q5v (in C), or None where that cannot be: another layout, K not a multiple
        of the record, N not a multiple of 16, scales that do not factor (weights not from Q4_K / Q6_K) or q8
        weights that are not 5-bit (not from Q5_0)."""
        lib = lib or load_qgemm()
        n, k = self.shape
        fmt = COMPACT.get(self.fmt)
        if fmt is None or k % RECORD_K[fmt] or n % GROUP or lib is None or not hasattr(lib, "int8_q5"):
            return None
        out = np.empty((n, k // QK * INT8_BLOCK_BYTES[fmt] // GROUP), dtype=np.uint8)
        src = np.ascontiguousarray(self.blocks)
        threads = torch.get_num_threads()
        if fmt == "q5v":
            failed = lib.int8_q5(src.ctypes.data, n, k // QK, out.ctypes.data, threads)
        else:
            failed = lib.int8_compact(
                _C_DEQUANT[self.fmt], src.ctypes.data, n, k // QK, out.ctypes.data, threads
            )
        return None if failed else QuantWeight(fmt, out, self.shape)

    def untiled(self) -> QuantWeight:
        """This q4t / q8t / q4v / q8v weight back in the q4 / q8 layout of qgemm.c (the same weights); itself
        otherwise."""
        if self.fmt in ("q8t", "q8v", "q5v"):
            return QuantWeight._q8(*self._q8_parts(), self.shape)
        if self.fmt in ("q6v", "q6kv"):
            return QuantWeight._q6(*self._q6_parts(), self.shape)
        if self.fmt not in ("q4t", "q4v", "q4kv"):
            return self
        d, m, q = self._q4_parts()
        return QuantWeight._q4(d, m, q[..., :16] | (q[..., 16:] << 4), self.shape)

    def for_kernels(self, lib: ctypes.CDLL | None = None) -> QuantWeight:
        """The layout `lib` (default: this CPU's kernels) multiplies: q4t / q8t on the AMX build where the shape
        allows (N a multiple of 16), else q4 / q8."""
        lib = lib or load_qgemm()
        return self.tiled() if getattr(lib, "isa", None) == "amx" else self.untiled()

    def take_rows(self, order: np.ndarray) -> QuantWeight:
        assert self.fmt in ("q4", "q8", "q6"), "reorder rows before tiling"
        return QuantWeight(self.fmt, np.ascontiguousarray(self.blocks[order]), self.shape)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight | None:
        """Rows of several weights stacked (fused qkv / gate_up), or None if their formats or K differ."""
        fmts, ks = {p.fmt for p in parts}, {p.shape[1] for p in parts}
        assert fmts <= {"q4", "q8", "q6"}, "stack rows before tiling"
        if len(fmts) != 1 or len(ks) != 1:
            return None
        n = sum(p.shape[0] for p in parts)
        return QuantWeight(parts[0].fmt, np.concatenate([p.blocks for p in parts]), (n, parts[0].shape[1]))

    def matmul(self, x: torch.Tensor, lib: ctypes.CDLL | None = None, isa: str | None = None) -> torch.Tensor:
        """x [M, K] float32 (CPU) -> x @ W^T [M, N] float32 (`lib`: a build_qgemm library; default: this CPU's).

        q4v / q8v weights quantize x to int8 (per row, per 32-block) and run `isa`'s integer kernel (a name in
        build.INT8_ISAS; default: the best this CPU has)."""
        lib = lib or load_qgemm()
        m = x.shape[0]
        n, k = self.shape
        x = x.contiguous()
        y = torch.empty(m, n, dtype=torch.float32)
        if m and self.fmt in INT8_FMT_CODE:
            isa = isa or int8_isa(lib)
            if isa is None:
                raise ValueError(
                    "int8 activations need the native kernels (x86-64 with AVX2 and FMA); this CPU has none"
                )
            code, fmt = INT8_ISAS[isa][0], INT8_FMT_CODE[self.fmt]
            lib.qgemm_i8(code, fmt, x.data_ptr(), m, k, self._ptr, n, y.data_ptr(), torch.get_num_threads())
        elif m:
            if self.fmt in TILED.values() and getattr(lib, "isa", None) != "amx":
                raise ValueError(f"a {self.fmt} weight needs the 'amx' kernel build")
            fn = getattr(lib, f"qgemm_{self.fmt}")
            fn(x.data_ptr(), m, k, self._ptr, n, y.data_ptr(), torch.get_num_threads())
        return y


def float_layout(fmt: str, lib: ctypes.CDLL | None = None) -> str:
    """The layout float32 activations multiply a `fmt` weight in on `lib` (default: this CPU's kernels), where its
    shape allows: q4t / q8t on the AMX build, `fmt` itself elsewhere."""
    lib = lib or load_qgemm()
    return TILED.get(fmt, fmt) if getattr(lib, "isa", None) == "amx" else fmt


def kernels_available() -> bool:
    """Whether GGUF weights can stay quantized here (x86-64 with AVX2/FMA, a C compiler, VERISPEC_KERNELS != 0)."""
    return load_qgemm() is not None
