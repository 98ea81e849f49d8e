"""The Triton kernels of verispec/kernels/cuda_ops.py (imported on first use on CUDA: a CPU run never loads
Triton). Each is batch-invariant by construction: one program per row (or per query row and head), a fixed block
and warp count, no reduction split that depends on how many rows there are."""

from __future__ import annotations

import triton
import triton.language as tl


# one program per row
@triton.jit
def rmsnorm(H, A, W, S, OUT, d, eps, HAS_A: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < d
    xf = tl.load(H + row * d + cols, mask=live, other=0.0).to(tl.float32)
    if HAS_A:
        # the residual sum rounded to the storage dtype, as h + a gives it
        xs = (xf + tl.load(A + row * d + cols, mask=live, other=0.0).to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + row * d + cols, xs, mask=live)
        xf = xs.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / d + eps)
    w = tl.load(W + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(OUT + row * d + cols, (xf * r * w).to(OUT.dtype.element_ty), mask=live)


# one program per (query row, head), over the query's visible keys (IDX [S*Q, t], CNT [S*Q]) in blocks of BLOCK_T.
# K and V are read in place from the paged cache: key position p of sequence s sits in block BLOCKS[s, p >> shift],
# row p & (2^shift - 1). Integer arguments whose value changes from step to step are not specialised on (a
# specialisation could change the kernel's layout and with it the order of a reduction).
@triton.jit(do_not_specialize="sq_s sq_h sq_q sb_s sk_b sk_h sk_t nq t group shift scale cap".split())
def attention(
    Q,
    K,
    V,
    BLOCKS,
    IDX,
    CNT,
    OUT,
    sq_s,
    sq_h,
    sq_q,
    sb_s,
    sk_b,
    sk_h,
    sk_t,
    nq,
    t,
    group,
    shift,
    scale,
    cap,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = pid // nq
    qi = pid % nq
    kh = h // group
    dd = tl.arange(0, BLOCK_D)
    dlive = dd < D
    # [BLOCK_D]
    qv = tl.load(Q + s * sq_s + h * sq_h + qi * sq_q + dd, mask=dlive, other=0.0).to(tl.float32)
    n = tl.load(CNT + pid)
    rowmask = (1 << shift) - 1
    kbase = K + kh * sk_h
    vbase = V + kh * sk_h
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(0, n, BLOCK_T):
        j = start + tl.arange(0, BLOCK_T)
        live = j < n
        key = tl.load(IDX + pid * t + j, mask=live, other=0).to(tl.int64)
        # [BLOCK_T] the key's block and row in the paged cache
        blk = tl.load(BLOCKS + s * sb_s + (key >> shift), mask=live, other=0).to(tl.int64)
        off = (blk * sk_b + (key & rowmask) * sk_t)[:, None] + dd[None, :]
        tile = live[:, None] & dlive[None, :]
        # [BLOCK_T, BLOCK_D]
        kb = tl.load(kbase + off, mask=tile, other=0.0).to(tl.float32)
        # [BLOCK_T]
        sc = tl.sum(kb * qv[None, :], axis=1) * scale
        if SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1)
            sc = cap * (1.0 - 2.0 / (tl.exp(2.0 * sc / cap) + 1.0))
        sc = tl.where(live, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        vb = tl.load(vbase + off, mask=tile, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vb, axis=0)
        m_i = m_new
    o = acc / l_i
    # [S, Q, Hq, D]
    tl.store(OUT + (pid * tl.num_programs(1) + h) * D + dd, o.to(OUT.dtype.element_ty), mask=dlive)
