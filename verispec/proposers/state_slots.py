"""Per-request bookkeeping of the drafters that read the target's hidden states into a KV cache of their own
(EAGLE, EAGLE-3, MTP and DFlash): a cache slot, how many positions the cache holds, and the target states that
arrived since the drafter last read them."""

from __future__ import annotations

import torch

from verispec.request import Request
from verispec.runner.kv_cache import KVCache

# pending states of one request kept as views (one per step) before they are copied into one tensor
_COMPACT_AFTER = 32


class StateSlots:
    """Base class: `add_request`, `remove_request` and `observe_hidden` of the proposer protocol for a drafter
    with its own cache. A subclass calls `_init_slots(cache)` and reads `slot`, `computed` and `pending`."""

    def _init_slots(self, cache: KVCache) -> None:
        self.cache = cache
        self.slot: dict[str, int] = {}
        # positions of the request already in the draft cache
        self.computed: dict[str, int] = {}
        # target states of positions computed[rid].. not yet read
        self.pending: dict[str, list[torch.Tensor]] = {}

    def add_request(self, req: Request) -> None:
        slot = self.cache.allocate()
        assert slot is not None, "the draft cache has as many slots as the target's"
        self.slot[req.request_id], self.computed[req.request_id], self.pending[req.request_id] = slot, 0, []

    def remove_request(self, req: Request, aborted: bool) -> None:
        slot = self.slot.pop(req.request_id, None)
        if slot is not None:
            self.cache.free(slot)
        self.computed.pop(req.request_id, None)
        self.pending.pop(req.request_id, None)

    def backlog(self, req: Request) -> int:
        # the states of positions computed[rid] .. num_computed - 1 wait to be read
        return req.num_computed - self.computed[req.request_id]

    def observe_hidden(self, reqs: list[Request], hidden: list[torch.Tensor]) -> None:
        # h [n, H]: positions num_computed - n .. num_computed - 1, in order (a view into the step's states)
        for r, h in zip(reqs, hidden):
            pending = self.pending[r.request_id]
            pending.append(h)
            # a request that has not drafted for a while holds copies of its own rows, not every step's states
            if len(pending) >= _COMPACT_AFTER:
                self.pending[r.request_id] = [torch.cat(pending)]
