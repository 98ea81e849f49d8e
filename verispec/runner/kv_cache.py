"""Slot-major KV cache with O(1) rollback.

One slot per running sequence: each layer holds K and V stacked on the head axis, [num_slots, 2*H_kv, T_alloc, D]
(one write per layer per step). A sequence's valid
length lives on its Request (num_computed); truncating it is moving that integer back, never a copy.
The last column (T_alloc - 1) is a scratch column that padded query rows write into and nobody reads.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from verispec.config import ModelConfig
from verispec.kernels.arena import anonymous_buffer

GiB = 1 << 30
# when the user gives none: enough for chat/code, cheap to allocate on a CPU
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class CacheBudget:
    num_slots: int
    max_model_len: int
    bytes_total: int


def plan_cache(
    cfg: ModelConfig,
    max_num_seqs: int,
    max_model_len: int | None,
    budget_bytes: int,
    lookahead: int = 0,
    dtype_bytes: int = 4,
) -> CacheBudget:
    """Decide slots and context length up front from the memory budget; ValueError if nothing fits."""
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
    t_alloc = max_model_len + lookahead + 1
    slots = min(max_num_seqs, budget_bytes // (t_alloc * per_tok))
    if slots < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes / GiB:.2f} GiB cannot hold one sequence of "
            f"max_model_len={max_model_len}; lower max_model_len"
        )
    return CacheBudget(
        num_slots=int(slots), max_model_len=int(max_model_len), bytes_total=int(slots * t_alloc * per_tok)
    )


def _zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed cache memory. On the CPU in float32, a private anonymous mapping: the OS hands out zero pages lazily,
    so a multi-GiB budget costs nothing until a slot's rows are written (torch.zeros would memset it all at
    start-up). Huge pages are refused for it: a slot's K/V rows of one head lie a head's stride apart, so its first
    tokens would touch (and the kernel zero) a 2 MiB page per head and layer (numpy's own allocations ask for huge
    pages; first prompts then spent much of their time zeroing pages)."""
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        buf = anonymous_buffer(4 * int(np.prod(shape)), huge_pages=False)
        return torch.from_numpy(buf.view(np.float32).reshape(shape))
    return torch.zeros(shape, device=device, dtype=dtype)


class KVCache:
    def __init__(
        self, cfg: ModelConfig, num_slots: int, t_alloc: int, device: torch.device, dtype: torch.dtype
    ):
        shape = (num_slots, 2 * cfg.num_kv_heads, t_alloc, cfg.head_dim)
        # zeros, not empty: masked keys are multiplied by 0 in attention and must never be NaN garbage
        self.kv = [_zeros(shape, device, dtype) for _ in range(cfg.num_layers)]
        self.num_slots, self.t_alloc = num_slots, t_alloc
        self.scratch = t_alloc - 1
        # min-heap: lowest slot first keeps active slots dense
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def free(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def copy_prefix(self, src: int, dst: list[int], n: int) -> None:
        """Positions [0, n) of slot src copied into every slot of dst, every layer (the step-cost profile's batch
        step: many sequences behind one context)."""
        if not dst or n <= 0:
            return
        d = torch.tensor(dst, device=self.kv[0].device)
        for kv in self.kv:
            kv[d, :, :n] = kv[src, :, :n]

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """K/V at positions src copied to dst in `slot`, every layer (a token tree's accepted path made contiguous)."""
        s, d = torch.tensor(src), torch.tensor(dst)
        # [slots, 2 Hkv, T, D]
        for kv in self.kv:
            kv[slot, :, d] = kv[slot, :, s]
