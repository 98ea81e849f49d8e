"""Fused CPU ops (ops.c) for the decode path: attention, residual add + RMSNorm, SiLU * up, greedy argmax,
sampled verification.

Each wrapper returns None when the fused kernel cannot take the inputs (not CPU float32, odd sizes, kernels
unavailable) and the caller runs its PyTorch version; both compute the same function.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from verispec.kernels.build import load_qgemm


def _usable(*xs: torch.Tensor) -> bool:
    # is_cpu / `is` instead of device.type == / == : this runs several times per layer per step
    f32 = torch.float32
    return all(x.is_cpu and x.dtype is f32 for x in xs) and load_qgemm() is not None


# how the KV cache stores K and V: the kernels' KV_F32 / KV_F16 / KV_BF16 (kernels.h)
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def kv_dtype_code(cache: torch.Tensor) -> int:
    return KV_DTYPE_CODES[cache.dtype]


def _cache_ok(cache: torch.Tensor) -> bool:
    """A KV cache (or a view of one) the kernels read and write: on the CPU, in one of KV_DTYPE_CODES' dtypes."""
    return cache.is_cpu and cache.dtype in KV_DTYPE_CODES


def _lengths_ok(qlen: torch.Tensor | None, s: int) -> bool:
    """qlen is None or [S] int64, contiguous, on the CPU."""
    return qlen is None or (
        qlen.is_cpu and qlen.dtype is torch.int64 and qlen.is_contiguous() and qlen.shape == (s,)
    )


def _table_ok(table: torch.Tensor, s: int) -> bool:
    """A block table's rows [S, nbt] int64 on the CPU, each row contiguous."""
    return table.is_cpu and table.dtype is torch.int64 and table.shape[0] == s and table.stride(-1) == 1


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def add_rmsnorm(
    h: torch.Tensor, a: torch.Tensor | None, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """h, a [N, D] -> (h + a, rmsnorm(h + a) * w) (a None: (h, rmsnorm(h) * w)); None if not applicable."""
    d = h.shape[-1]
    if h.dim() != 2 or d % 8 or not _usable(h, w) or (a is not None and not _usable(a)):
        return None
    h = h.contiguous()
    s = h if a is None else torch.empty_like(h)
    a_ptr = None if a is None else a.contiguous().data_ptr()
    out = torch.empty_like(h)
    load_qgemm().add_rmsnorm_f32(
        h.data_ptr(), a_ptr, w.data_ptr(), h.shape[0], d, eps, s.data_ptr(), out.data_ptr()
    )
    return s, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [N, 2I] -> silu(gate) * up [N, I]; None if not applicable."""
    if gate_up.dim() != 2 or not _usable(gate_up):
        return None
    gate_up = gate_up.contiguous()
    n, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, i)
    load_qgemm().silu_mul_f32(gate_up.data_ptr(), n, i, out.data_ptr(), torch.get_num_threads())
    return out


def attention(
    # [S, Hq, Q, D] (any strides, D contiguous)
    q: torch.Tensor,
    # [S, Hkv, T, D] cache view
    k: torch.Tensor,
    # [S, Hkv, T, D], same strides as k
    v: torch.Tensor,
    # [S, 1, Q, T] bool
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    # [S] int64: sequence s's real rows are 0 .. qlen[s] - 1, the rest padding (left uncomputed); None: all Q
    qlen: torch.Tensor | None = None,
    # a paged cache: (block table [S, nbt] int64 rows, log2 of the block size, keys to read); k and v are then the
    # cache's K and V heads [num_blocks, Hkv, block_size, D]
    paged: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor | None:
    """-> [S, Q, Hq * D] (the layout o_proj reads), or None if not applicable."""
    s, hq, nq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    blocks, nbt, shift = None, 0, 0
    if paged is not None:
        table, shift, t = paged
        if not _table_ok(table, s):
            return None
        blocks, nbt = table.data_ptr(), table.stride(0)
    if d % 8 or q.stride(-1) != 1 or k.stride(-1) != 1 or k.stride() != v.stride() or not _usable(q):
        return None
    if not (_cache_ok(k) and v.dtype is k.dtype and v.is_cpu):
        return None
    if mask is not None and (mask.dtype != torch.bool or mask.stride(-1) != 1 or mask.shape[1] != 1):
        return None
    if not _lengths_ok(qlen, s):
        return None
    out = torch.empty(s, nq, hq * d)
    qs, qh, qq, _ = q.stride()
    ks, kh, kt, _ = k.stride()
    m_ptr, ms, mq = (mask.data_ptr(), mask.stride(0), mask.stride(2)) if mask is not None else (None, 0, 0)
    if mask is not None and mask.shape[0] == 1:
        # broadcast over rows
        ms = 0
    load_qgemm().attention_f32(
        q.data_ptr(),
        s,
        hq,
        nq,
        d,
        qs,
        qh,
        qq,
        k.data_ptr(),
        v.data_ptr(),
        hkv,
        t,
        ks,
        kh,
        kt,
        blocks,
        nbt,
        shift,
        m_ptr,
        ms,
        mq,
        scale,
        float(softcap or 0.0),
        out.data_ptr(),
        _ptr(qlen),
        torch.get_num_threads(),
        kv_dtype_code(k),
    )
    return out


def rope_(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, qlen: torch.Tensor | None = None
) -> bool:
    """In place on x [S, H, Q, D] (a view, D contiguous) with cos / signed_sin [S, 1, Q, D]; False if not applied.
    qlen [S] int64: only rows t < qlen[s] (the rest is padding); None: all."""
    s, h, nq, d = x.shape
    if d > 1024 or x.stride(-1) != 1 or not _usable(x, cos, signed_sin) or not _lengths_ok(qlen, s):
        return False
    if not (cos.is_contiguous() and signed_sin.is_contiguous() and cos.shape == (s, 1, nq, d)):
        return False
    xs, xh, xq, _ = x.stride()
    load_qgemm().rope_f32(
        x.data_ptr(), s, h, nq, d, xs, xh, xq, cos.data_ptr(), signed_sin.data_ptr(), _ptr(qlen)
    )
    return True


def write_kv(
    cache: torch.Tensor,
    x: torch.Tensor,
    pos: torch.Tensor,
    qlen: torch.Tensor | None = None,
    paged: tuple[torch.Tensor, int] | None = None,
) -> bool:
    """cache [S, H, T, D] view, x [S, H, Q, D] view, pos [S, Q] int64: cache[s, :, pos[s, t]] = x[s, :, t]
    (qlen [S] int64: for t < qlen[s] only; None: all). paged = (block table [S, nbt] int64 rows, log2 of the block
    size): cache is the paged cache [num_blocks, H, block_size, D] and position p of sequence s lies in its block
    table[s, p >> shift]."""
    s, h, nq, d = x.shape
    if cache.stride(-1) != 1 or x.stride(-1) != 1 or not _usable(x) or not _cache_ok(cache):
        return False
    if not _lengths_ok(qlen, s):
        return False
    blocks, nbt, shift = None, 0, 0
    if paged is not None:
        if not _table_ok(paged[0], s):
            return False
        blocks, nbt, shift = paged[0].data_ptr(), paged[0].stride(0), paged[1]
    if pos.dtype != torch.int64 or not pos.is_contiguous() or pos.shape != (s, nq):
        return False
    cs, ch, ct, _ = cache.stride()
    xs, xh, xq, _ = x.stride()
    load_qgemm().write_kv_f32(
        cache.data_ptr(),
        cs,
        ch,
        ct,
        x.data_ptr(),
        xs,
        xh,
        xq,
        pos.data_ptr(),
        s,
        h,
        nq,
        d,
        _ptr(qlen),
        blocks,
        nbt,
        shift,
        kv_dtype_code(cache),
    )
    return True


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """x [N, V] -> torch.argmax(x, dim=-1) [N] int64 (first maximum, NaN largest); None if not applicable.

    torch's CPU argmax over a batch of full-vocabulary logits was a few percent of a batch-8 decode step."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[-1] == 0 or not _usable(x):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load_qgemm().argmax_rows_f32(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out


def apply_bitmask(x: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> bool:
    """Structured outputs: -inf in row rows[r] of x [N, V] (CPU float32, rows contiguous) at every token the int32
    bitmask row r [R, W] refuses (ops.c apply_bitmask_f32), in place. False (nothing done) where the kernel does
    not apply."""
    if not (
        verify_applies(x) and bitmask.is_contiguous() and bitmask.dtype is torch.int32 and bitmask.is_cpu
    ):
        return False
    load_qgemm().apply_bitmask_f32(
        x.data_ptr(), x.shape[1], x.stride(0), bitmask.data_ptr(), bitmask.shape[1], _i64(rows), len(rows)
    )
    return True


def verify_applies(x: torch.Tensor) -> bool:
    """Whether verify_greedy and verify_sampled take logits x [N, V] (CPU float32, rows contiguous, kernels
    built)."""
    return x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] > 0 and _usable(x)


def verify_greedy(
    # [N, V] float32 logits, rows contiguous
    x: torch.Tensor,
    # [B, K+1] int64: the row of x scoring each request's position
    rows: torch.Tensor,
    # [B, K] int64, -1 padded
    drafts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Greedy verification straight from logits (ops.c verify_greedy_f32): accept drafts while each equals its
    row's argmax. -> (emitted token [B]: the argmax at the first differing draft or the bonus row, accepted drafts
    [B]); None if not applicable. Takes the argmax of only the rows a request reaches."""
    if not verify_applies(x):
        return None
    b, k = drafts.shape
    rows, drafts = rows.to(torch.int64).contiguous(), drafts.to(torch.int64).contiguous()
    tokens, accepted = torch.empty(b, dtype=torch.int64), torch.empty(b, dtype=torch.int64)
    load_qgemm().verify_greedy_f32(
        x.data_ptr(),
        x.shape[1],
        x.stride(0),
        b,
        k,
        rows.data_ptr(),
        drafts.data_ptr(),
        tokens.data_ptr(),
        accepted.data_ptr(),
        torch.get_num_threads(),
    )
    return tokens, accepted


def verify_sampled(
    # [N, V] float32 logits, rows contiguous
    x: torch.Tensor,
    # [B, K+1] int64: the row of x scoring each request's position
    rows: torch.Tensor,
    # [B, K] int64, -1 padded
    drafts: torch.Tensor,
    # [B] float32: 1 / temperature
    scale: torch.Tensor,
    # [B, K] float32 U[0, 1), or None for strict verification
    u_accept: torch.Tensor | None,
    # [B, K+1] float32 U[0, 1)
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Sampled verification straight from logits (ops.c verify_sampled_f32): strict when u_accept is None, else
    probabilistic with a one-hot draft distribution. -> (emitted token [B], accepted drafts [B]); None if not
    applicable. Scores only the rows a request reaches (its accepted drafts + 1) and never writes a [rows, V]
    distribution."""
    if not verify_applies(x):
        return None
    b, k = drafts.shape
    f32, i64 = torch.float32, torch.int64
    rows, drafts = rows.to(i64).contiguous(), drafts.to(i64).contiguous()
    scale, u_sample = scale.to(f32).contiguous(), u_sample.to(f32).contiguous()
    u_acc = None if u_accept is None else u_accept.to(f32).contiguous()
    tokens, accepted = torch.empty(b, dtype=i64), torch.empty(b, dtype=i64)
    load_qgemm().verify_sampled_f32(
        x.data_ptr(),
        x.shape[1],
        x.stride(0),
        b,
        k,
        rows.data_ptr(),
        drafts.data_ptr(),
        scale.data_ptr(),
        None if u_acc is None else u_acc.data_ptr(),
        u_sample.data_ptr(),
        tokens.data_ptr(),
        accepted.data_ptr(),
        torch.get_num_threads(),
    )
    return tokens, accepted


def _i64(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def verify_greedy_host(
    x: torch.Tensor, rows: Sequence[int], drafts: Sequence[int], b: int, k: int
) -> tuple[list[int], list[int]] | None:
    """verify_greedy with its small inputs as flat Python lists (rows [B * (K+1)], drafts [B * K], -1 padded) and
    its outputs as lists: no torch op around the kernel. After a forward has streamed the weights through the
    caches, each small torch op of a step costs tens of microseconds. None if not applicable."""
    if not verify_applies(x):
        return None
    tokens, accepted = _i64([0] * b), _i64([0] * b)
    load_qgemm().verify_greedy_f32(
        x.data_ptr(),
        x.shape[1],
        x.stride(0),
        b,
        k,
        _i64(rows),
        _i64(drafts),
        tokens,
        accepted,
        torch.get_num_threads(),
    )
    return list(tokens), list(accepted)


def verify_sampled_host(
    x: torch.Tensor,
    rows: Sequence[int],
    drafts: Sequence[int],
    temperature: Sequence[float],
    u_sample: Sequence[float],
    b: int,
    k: int,
) -> tuple[list[int], list[int]] | None:
    """Strict sampled verification (verify_sampled without u_accept) from flat Python lists: rows [B * (K+1)],
    drafts [B * K] (-1 padded), temperature [B], u_sample [B * (K+1)]. None if not applicable."""
    if not verify_applies(x):
        return None
    # 1 / t as float32 division of float32(t) gives it (the tensor path's 1.0 / temperature): a quotient in double
    # rounded once more to float32 is the correctly rounded float32 quotient
    scale = [1.0 / ctypes.c_float(t).value for t in temperature]
    tokens, accepted = _i64([0] * b), _i64([0] * b)
    load_qgemm().verify_sampled_f32(
        x.data_ptr(),
        x.shape[1],
        x.stride(0),
        b,
        k,
        _i64(rows),
        _i64(drafts),
        (ctypes.c_float * b)(*scale),
        None,
        (ctypes.c_float * len(u_sample))(*u_sample),
        tokens,
        accepted,
        torch.get_num_threads(),
    )
    return list(tokens), list(accepted)
