"""Causal / tree attention over the paged KV cache.

The cache for one layer is [num_blocks, 2*H_kv, block_size, D] (K heads then V heads, runner/kv_cache.py). A forward
covers a contiguous slot range [lo, hi); the block table's rows of those slots map each sequence's positions to
blocks. The C kernels and the CUDA path's Triton kernel read the blocks in place; the PyTorch path gathers a
sequence's blocks first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from verispec.kernels import cuda_ops, ops


@dataclass
class AttnContext:
    """Everything attention needs for one forward; built once, shared by all layers."""

    slot_lo: int
    slot_hi: int
    # [S, 1] arange, for cache writes
    rows: torch.Tensor
    # [S, Q] where each new token's K/V is written (a position in its sequence)
    cache_pos: torch.Tensor
    # keys [0, kv_len) are read
    kv_len: int
    # [S, 1, Q, kv_len] bool, True = attend (None: attend all, S == Q == 1)
    mask: torch.Tensor | None
    # same, restricted to the sliding window (Gemma 3)
    sliding_mask: torch.Tensor | None = None
    # Q, the padded number of new tokens per row
    q_len: int = 1
    # [S*Q] packed row feeding each padded position (None: identity)
    unpack: torch.Tensor | None = None
    # [N] padded position of each packed token (None: identity)
    pack: torch.Tensor | None = None
    # [S] int64 real rows of each sequence, 0 .. qlen[s] - 1 (None: no padding); the kernels skip the rest
    qlen: torch.Tensor | None = None
    # [S, blocks_per_slot] int64: the block table rows of slots [lo, hi)
    blocks: torch.Tensor | None = None
    # log2 of the block size
    block_shift: int = 4
    # cuda_ops.visible_keys of mask / sliding_mask, made on first use (CUDA only)
    _visible: dict[bool, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (block, row) of each cache_pos, made on first use (the PyTorch path's KV write)
    _where: tuple[torch.Tensor, torch.Tensor] | None = None

    def visible(self, sliding: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's visible keys, compacted once per forward for the batch-invariant CUDA attention."""
        if sliding not in self._visible:
            mask = self.sliding_mask if sliding else self.mask
            device = self.rows.device
            self._visible[sliding] = cuda_ops.visible_keys(mask, self.kv_len, device)
        return self._visible[sliding]

    def where(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, Q] block and row of each new token's position, once per forward (every layer writes there)."""
        if self._where is None:
            blk = torch.gather(self.blocks, 1, self.cache_pos >> self.block_shift)
            self._where = blk, self.cache_pos & ((1 << self.block_shift) - 1)
        return self._where

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """[N, F] packed tokens -> [S, Q, F]."""
        if self.unpack is not None:
            x = x.index_select(0, self.unpack)
        return x.view(self.slot_hi - self.slot_lo, self.q_len, x.shape[-1])

    def to_packed(self, x: torch.Tensor) -> torch.Tensor:
        """[S, Q, F] -> [N, F] real tokens only."""
        x = x.reshape(-1, x.shape[-1])
        return x.index_select(0, self.pack) if self.pack is not None else x


def write_kv(cache: torch.Tensor, ctx: AttnContext, x: torch.Tensor) -> None:
    """Write new K|V x [S, 2*Hkv, Q, D] at the rows' positions into the paged cache [blocks, 2*Hkv, bs, D]."""
    if not ops.write_kv(cache, x, ctx.cache_pos, ctx.qlen, (ctx.blocks, ctx.block_shift)):
        blk, row = ctx.where()
        cache[blk, :, row] = x.transpose(1, 2).to(cache.dtype)


def read_kv(cache: torch.Tensor, ctx: AttnContext, dtype: torch.dtype) -> torch.Tensor:
    """The rows' K|V [S, 2*Hkv, kv_len, D] in `dtype` (the queries'; the cache may store a narrower one), gathered
    from their blocks (a copy: the PyTorch path)."""
    bs = 1 << ctx.block_shift
    n = -(-ctx.kv_len // bs)
    # [S, n, 2Hkv, bs, D]
    g = cache[ctx.blocks[:, :n]]
    s, _, h, _, d = g.shape
    return g.transpose(1, 2).reshape(s, h, n * bs, d)[:, :, : ctx.kv_len].to(dtype)


def attention(
    # [S, Hq, Q, D]
    q: torch.Tensor,
    # [S, Hkv, T, D] (a cache view)
    k: torch.Tensor,
    # [S, Hkv, T, D]
    v: torch.Tensor,
    # [S, 1, Q, T] bool
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """-> [S, Hq, Q, D]. Grouped-query heads share K/V without copying them."""
    s, hq, nq, d = q.shape
    hkv = k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    g = hq // hkv
    # [S, Hkv, G*Q, D]
    qg = q.reshape(s, hkv, g * nq, d)
    # [S, Hkv, G*Q, T]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        # [S, 1, G*Q, T]
        m = mask.expand(s, 1, nq, mask.shape[-1]).repeat(1, 1, g, 1)
        scores = scores.masked_fill(~m, float("-inf"))
    # [S, Hkv, G*Q, D]
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out.reshape(s, hq, nq, d)
