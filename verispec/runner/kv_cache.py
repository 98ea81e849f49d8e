"""The paged KV cache: fixed-size blocks of K and V per layer, a block table per sequence slot.

Each layer holds [num_blocks, 2*H_kv, block_size, D] (K heads then V heads; one write per layer per step). A running
sequence owns a slot, the row of the block table that maps its positions to blocks (position p in block
table[slot, p // block_size]). Its valid length lives on its Request (num_computed): truncating it (rejected drafts)
is moving that integer back, never a copy. Blocks come from a BlockPool (runner/block_pool.py): on demand for the
engine's cache (grow), or, for the drafters' caches, all of a slot's blocks when the slot is taken (reserve_all).
Position t_alloc - 1 is a scratch position that padded query rows write into and nobody reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from verispec.config import ModelConfig
from verispec.kernels.arena import anonymous_buffer
from verispec.runner.block_pool import NULL_BLOCK, BlockPool

GiB = 1 << 30
# when the user gives none: enough for chat/code, cheap to allocate on a CPU
DEFAULT_MAX_MODEL_LEN = 4096
# vLLM's default and accepted block sizes (tokens per block)
DEFAULT_BLOCK_SIZE = 16
BLOCK_SIZES = (8, 16, 32, 64, 128)
# vLLM's kv_cache_dtype values this build stores K and V in (its fp8 ones are refused by name)
KV_CACHE_DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def check_kv_cache_dtype(name: object) -> None:
    """ValueError naming kv_cache_dtype and the allowed values for one this build cannot store."""
    if name not in KV_CACHE_DTYPES:
        allowed = ", ".join(KV_CACHE_DTYPES)
        extra = " (fp8 caches are not built for the CPU kernels)" if str(name).startswith("fp8") else ""
        raise ValueError(f"kv_cache_dtype={name!r} is not supported{extra}; allowed: {allowed}")


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype, activation_dtype: str) -> torch.dtype:
    """The dtype K and V are stored in. "auto": the model's (float32 on the CPU: transformers' numerics), but
    float16 under int8 activations (llama.cpp's numerics, whose default cache type it is)."""
    check_kv_cache_dtype(name)
    if name != "auto":
        return KV_CACHE_DTYPES[name]
    return torch.float16 if activation_dtype == "int8" else model_dtype


@dataclass(frozen=True)
class CacheBudget:
    num_slots: int
    max_model_len: int
    # blocks in the pool, the null block included
    num_blocks: int
    bytes_total: int


def plan_cache(
    cfg: ModelConfig,
    max_num_seqs: int,
    max_model_len: int | None,
    budget_bytes: int,
    lookahead: int = 0,
    dtype_bytes: int = 4,
    block_size: int = DEFAULT_BLOCK_SIZE,
    full_length_slots: bool = False,
) -> CacheBudget:
    """Decide the context length and the block pool up front from the memory budget; ValueError if one sequence
    of max_model_len does not fit. The pool never exceeds what max_num_seqs full-length sequences would take.
    full_length_slots: no more slots than full-length sequences fit (a draft model's own cache holds each of its
    slots at full length)."""
    per_tok = cfg.kv_bytes_per_token * dtype_bytes // 4
    if max_model_len is None:
        fit = budget_bytes // max(1, max_num_seqs * per_tok) - lookahead - 1
        max_model_len = min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN, max(fit, 0))
        if max_model_len < 16:
            raise ValueError(
                f"KV cache budget of {budget_bytes / GiB:.2f} GiB cannot hold max_num_seqs={max_num_seqs} "
                "sequences; lower max_num_seqs or set max_model_len"
            )
    elif max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than the model's max_position_embeddings="
            f"{cfg.max_position_embeddings}"
        )
    per_seq = -(-(max_model_len + lookahead + 1) // block_size)
    blocks = min(budget_bytes // (block_size * per_tok), max_num_seqs * per_seq)
    if blocks < per_seq:
        raise ValueError(
            f"KV cache budget of {budget_bytes / GiB:.2f} GiB cannot hold one sequence of "
            f"max_model_len={max_model_len}; lower max_model_len"
        )
    slots = min(max_num_seqs, blocks // per_seq) if full_length_slots else max_num_seqs
    return CacheBudget(
        num_slots=int(slots),
        max_model_len=int(max_model_len),
        num_blocks=int(blocks) + 1,
        bytes_total=int(blocks * block_size * per_tok),
    )


def _zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed cache memory. On the CPU (float32, float16 or bfloat16), a private anonymous mapping: the OS hands out zero pages lazily,
    so a multi-GiB budget costs nothing until a slot's rows are written (torch.zeros would memset it all at
    start-up). Huge pages are refused for it: a slot's K/V rows of one head lie a head's stride apart, so its first
    tokens would touch (and the kernel zero) a 2 MiB page per head and layer (numpy's own allocations ask for huge
    pages; first prompts then spent much of their time zeroing pages)."""
    if torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float16, torch.bfloat16):
        buf = anonymous_buffer(dtype.itemsize * int(np.prod(shape)), huge_pages=False)
        raw = buf.view(np.float32 if dtype.itemsize == 4 else np.int16).reshape(shape)
        return torch.from_numpy(raw).view(dtype)
    return torch.zeros(shape, device=device, dtype=dtype)


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        t_alloc: int,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ):
        """num_blocks: the pool (block 0 the null block), blocks taken as sequences grow; None: every slot holds
        t_alloc positions from the start (the drafters' caches, and callers that address slots directly)."""
        if block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size={block_size} is not supported; choose one of {list(BLOCK_SIZES)}")
        self.block_size, self.block_shift = block_size, block_size.bit_length() - 1
        # table columns: every position a slot can hold
        self.blocks_per_slot = -(-t_alloc // block_size)
        self.reserve_all = num_blocks is None
        if num_blocks is None:
            num_blocks = num_slots * self.blocks_per_slot + 1
        shape = (num_blocks, 2 * cfg.num_kv_heads, block_size, cfg.head_dim)
        # zeros, not empty: masked keys are multiplied by 0 in attention and must never be NaN garbage
        self.kv = [_zeros(shape, device, dtype) for _ in range(cfg.num_layers)]
        self.pool = BlockPool(num_blocks)
        # [num_slots, blocks_per_slot] int64; NULL_BLOCK where a slot holds nothing
        self.block_table = torch.full(
            (num_slots, self.blocks_per_slot), NULL_BLOCK, dtype=torch.long, device=device
        )
        # each slot's blocks in position order (the table's host copy)
        self.blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self.num_slots, self.t_alloc = num_slots, t_alloc
        self.scratch = t_alloc - 1
        self._free_slots = list(range(num_slots - 1, -1, -1))
        if self.reserve_all:
            for slot in range(num_slots):
                self.grow(slot, t_alloc)

    @property
    def num_free(self) -> int:
        """Free slots."""
        return len(self._free_slots)

    @property
    def usage(self) -> float:
        """The share of blocks in use (vLLM's kv_cache_usage_perc; cached free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def allocate(self) -> int | None:
        """A free slot (lowest first: keeps active slots dense), holding no blocks, or all of its blocks in
        reserve_all mode; None if none is free."""
        if not self._free_slots:
            return None
        return self._free_slots.pop()

    def free(self, slot: int) -> None:
        if not self.reserve_all:
            self.release(slot)
        self._free_slots.append(slot)
        self._free_slots.sort(reverse=True)

    def release(self, slot: int) -> None:
        """Give back the slot's blocks (it holds none after; in reserve_all mode, nothing to give back)."""
        if self.reserve_all:
            return
        self.pool.free(self.blocks[slot])
        self.blocks[slot] = []
        self.block_table[slot].fill_(NULL_BLOCK)

    @contextmanager
    def borrowed(self, slots: Iterable[int], n: int) -> Iterator[None]:
        """Free slots holding positions [0, n) for a while (the step-cost profile, the audit's plain forwards: their
        contents are scratch), their blocks given back after."""
        slots = list(slots)
        try:
            for s in slots:
                if not self.grow(s, n):
                    raise ValueError(f"the KV cache has too few free blocks for {len(slots)} x {n} positions")
            yield
        finally:
            for s in slots:
                self.release(s)

    def blocks_needed(self, slot: int, n: int) -> int:
        """New blocks for the slot to hold positions [0, n)."""
        return max(0, self._blocks_for(n) - len(self.blocks[slot]))

    def grow(self, slot: int, n: int) -> bool:
        """Make the slot hold positions [0, n) (n <= t_alloc); False, and nothing taken, if too few blocks are free."""
        need = self.blocks_needed(slot, n)
        if need == 0:
            return True
        if need > self.pool.num_free:
            return False
        self._append(slot, self.pool.allocate(need))
        return True

    def adopt(self, slot: int, blocks: list[int]) -> None:
        """Put blocks (a cached prefix, already referenced for this slot) at the start of an empty slot."""
        assert not self.blocks[slot]
        self._append(slot, blocks)

    def _append(self, slot: int, new: list[int]) -> None:
        have = len(self.blocks[slot])
        self.blocks[slot] += new
        self.block_table[slot, have : have + len(new)] = torch.tensor(new, dtype=torch.long)

    def _blocks_for(self, n: int) -> int:
        return min(self.blocks_per_slot, -(-n // self.block_size))

    def physical(self, slot: int, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks, rows in them) of a slot's positions."""
        pos = torch.tensor(positions, dtype=torch.long, device=self.block_table.device)
        return self.block_table[slot, pos >> self.block_shift], pos & (self.block_size - 1)

    def copy_prefix(self, src: int, dst: list[int], n: int) -> None:
        """Positions [0, n) of slot src copied into every slot of dst (grown to hold them), every layer (the
        step-cost profile's batch step: many sequences behind one context)."""
        if not dst or n <= 0:
            return
        k = self._blocks_for(n)
        for d in dst:
            if not self.grow(d, n):
                raise ValueError("the KV cache has too few free blocks for the copies")
        s = torch.tensor(self.blocks[src][:k], dtype=torch.long)
        for d in dst:
            t = torch.tensor(self.blocks[d][:k], dtype=torch.long)
            for kv in self.kv:
                kv[t] = kv[s]

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """K/V at positions src copied to dst in `slot`, every layer (a token tree's accepted path made contiguous)."""
        sb, sr = self.physical(slot, src)
        db, dr = self.physical(slot, dst)
        # [blocks, 2 Hkv, block_size, D]
        for kv in self.kv:
            kv[db, :, dr] = kv[sb, :, sr]
