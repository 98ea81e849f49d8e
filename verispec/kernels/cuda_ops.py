"""Batch-invariant CUDA ops: a row's result never depends on which other rows share its forward.

Speculative verification scores K+1 rows of a request in one forward where plain decoding scores one; greedy
output stays token for token the same only if each row's logits are bitwise the same either way. The CPU kernels
(ops.c, qgemm*.c) are built that way; cuBLAS, PyTorch's CUDA reductions and scaled_dot_product_attention are not
(their kernels and reduction trees change with the number of rows). On CUDA the decoder runs these instead:

- `linear`: x W^T as cuBLAS products of exactly CHUNK rows each (the last one padded), so every row goes through
  the same kernel with the same reduction order whatever the batch.
- `add_rmsnorm`: one Triton program per row, float32 inside, a fixed block and warp count.
- `attention`: one Triton program per (query row, head) over that query's visible keys in cache order (the
  mask compacted once per forward by `visible_keys`), in blocks of a fixed size counted from its first visible key;
  a query sees the same key sequence whether it is decoded alone, verified as a draft, or a node of a token tree,
  so its output is bitwise the same. It reads K and V in place through the block table of the paged cache (no
  gathered copy), widening the cache's dtype to float32 exactly as the CPU kernels do.

The layers call them where `applies` (a CUDA tensor, Triton installed, no autograd) and run their PyTorch versions
elsewhere. The Triton kernels (cuda_kernels.py) are imported on first use; with TRITON_INTERPRET=1 set before
Triton is imported they also run on CPU tensors (the tests).
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

# rows per cuBLAS product in `linear`
CHUNK = 64
HAVE_TRITON = importlib.util.find_spec("triton") is not None
_kernels: ModuleType | None = None


def kernels() -> ModuleType:
    """verispec.kernels.cuda_kernels, imported on first use."""
    global _kernels
    if _kernels is None:
        from verispec.kernels import cuda_kernels

        if os.environ.get("TRITON_INTERPRET") == "1":
            _fix_interpreter()
        _kernels = cuda_kernels
    return _kernels


def _fix_interpreter() -> None:
    """Under Triton's interpreter a loaded scalar is a 1-element array, which numpy 2 no longer turns into an int:
    give its tensors __index__ so that a loop bound read from memory (attention's key count) works there too."""
    import triton.runtime.interpreter as interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "verispec", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.verispec = True
    interpreter._patch_lang_tensor = patched


def applies(x: torch.Tensor) -> bool:
    """Whether the decoder runs these ops on x: a CUDA tensor, Triton installed, no autograd (training a draft
    keeps PyTorch's differentiable ops)."""
    return x.is_cuda and HAVE_TRITON and not torch.is_grad_enabled()


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) in products of CHUNK rows each: a row's result does not depend on
    how many rows come with it."""
    k, n = weight.shape[1], weight.shape[0]
    # [M, K]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    wt = weight.t()
    if m <= CHUNK:
        # decoding and most verification steps: one product, its rows past m whatever the buffer last held (a row's
        # result never reads another row)
        buf = _pad_buffer(k, x2)
        buf[:m].copy_(x2)
        out = torch.mm(buf, wt)[:m]
    else:
        rows = -(-m // CHUNK) * CHUNK
        if rows != m or not x2.is_contiguous() or x2.data_ptr() % 16:
            padded = x2.new_zeros(rows, k)
            padded[:m] = x2
            x2 = padded
        # [rows, N]
        out = x2.new_empty(rows, n)
        for i in range(0, rows, CHUNK):
            torch.mm(x2[i : i + CHUNK], wt, out=out[i : i + CHUNK])
        out = out[:m]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)


# (K, dtype, device) -> [CHUNK, K] input buffer of `linear`'s one-product calls; the stream orders its reuse
_pads: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _pad_buffer(k: int, like: torch.Tensor) -> torch.Tensor:
    key = (k, like.dtype, like.device)
    buf = _pads.get(key)
    if buf is None:
        # a normal tensor (not an inference one), which any mode may write
        with torch.inference_mode(False):
            buf = _pads[key] = torch.zeros(CHUNK, k, dtype=like.dtype, device=like.device)
    return buf


def add_rmsnorm(
    h: torch.Tensor, a: torch.Tensor | None, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h, a [..., D] -> (h + a, rmsnorm(h + a) * w) (a None: (h, rmsnorm(h) * w)), row by row."""
    d = h.shape[-1]
    # [R, D]
    h2 = h.reshape(-1, d).contiguous()
    rows = h2.shape[0]
    s = h2 if a is None else torch.empty_like(h2)
    a2 = h2 if a is None else a.reshape(-1, d).contiguous()
    out = torch.empty_like(h2)
    if rows:
        kernels().rmsnorm[(rows,)](
            h2, a2, w, s, out, d, eps, HAS_A=a is not None, BLOCK=_next_pow2(d), num_warps=4
        )
    return s.view(h.shape), out.view(h.shape)


def visible_keys(
    mask: torch.Tensor | None, t: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [S, 1, Q, T] bool (None: one query that sees all t keys) -> (idx [S, Q, T] int32: each query's
    visible keys in increasing order first, cnt [S, Q] int32: how many). One kernel variant serves every case."""
    if mask is None:
        # every key, in order: nothing to sort
        idx = torch.arange(t, dtype=torch.int32, device=device).view(1, 1, t)
        return idx, torch.full((1, 1), t, dtype=torch.int32, device=device)
    m = mask[:, 0]
    key = torch.arange(t, device=m.device, dtype=torch.int32).expand(m.shape)
    # masked keys sort after every visible one
    idx = torch.where(m, key, t).sort(dim=-1).values
    return idx.contiguous(), m.sum(-1, dtype=torch.int32)


def attention(
    # [S, Hq, Q, D] (D contiguous)
    q: torch.Tensor,
    # paged: the cache's K heads [num_blocks, Hkv, bs, D]; else the rows' keys [S, Hkv, T, D] (D contiguous)
    k: torch.Tensor,
    # the V heads, same shape and strides as k
    v: torch.Tensor,
    scale: float,
    softcap: float | None,
    # visible_keys(mask, T), one row per sequence
    visible: tuple[torch.Tensor, torch.Tensor],
    # (block table rows [S, n] int64, log2 of bs): k and v are read in place through it
    paged: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor | None:
    """-> [S, Q, Hq * D] (the layout o_proj reads), or None where the kernel does not take the strides."""
    s, hq, nq, d = q.shape
    hkv = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k.stride() != v.stride():
        return None
    if paged is None:
        # each sequence's keys as one block of 2^shift >= T rows
        blocks = torch.arange(s, dtype=torch.int64, device=q.device).view(s, 1)
        shift = max(k.shape[2] - 1, 0).bit_length()
    else:
        blocks, shift = paged
        blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    out = torch.empty(s, nq, hq * d, dtype=q.dtype, device=q.device)
    idx, cnt = visible
    block_d = _next_pow2(d)
    kernels().attention[(s * nq, hq)](
        q,
        k,
        v,
        blocks,
        idx,
        cnt,
        out,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        blocks.stride(0),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        nq,
        idx.shape[-1],
        hq // hkv,
        shift,
        scale,
        float(softcap or 1.0),
        D=d,
        BLOCK_D=block_d,
        BLOCK_T=max(16, 4096 // block_d),
        SOFTCAP=softcap is not None,
        num_warps=4,
    )
    return out
