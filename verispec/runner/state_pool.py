"""The target states a drafter reads at every position (EAGLE, EAGLE-3, MTP, DFlash), kept beside the KV cache in
the same blocks: position p of a sequence has its state where its K/V is, at (block_table[slot, p // block_size],
p % block_size). A block's states live exactly as long as its K/V: a prefix-cache hit finds both, and a reused
block overwrites both. On a hit the engine hands the drafter the cached positions' states, which it reads as if the
target had just computed them (its own cache catches up on them before it drafts).
"""

from __future__ import annotations

import torch

from verispec.runner.kv_cache import KVCache


class StatePool:
    """[num_blocks, block_size, width] states (width: the hidden size, or the aux layers' streams side by side),
    allocated on the first write (the width is the drafter's)."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.states: torch.Tensor | None = None

    def write(self, slot: int, start: int, states: torch.Tensor) -> None:
        """states [n, width] of positions start .. start + n - 1 of `slot`."""
        if self.states is None:
            c = self.cache
            self.states = states.new_zeros(c.pool.num_blocks, c.block_size, states.shape[-1])
        blocks, rows = self.cache.physical(slot, list(range(start, start + states.shape[0])))
        self.states[blocks, rows] = states

    def read(self, slot: int, n: int) -> torch.Tensor | None:
        """[n, width] the states of positions 0 .. n - 1 of `slot` (None before any write)."""
        if self.states is None:
            return None
        blocks, rows = self.cache.physical(slot, list(range(n)))
        return self.states[blocks, rows]
