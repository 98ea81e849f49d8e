"""StateSlots: the unread target states of a drafter with a cache of its own."""

from __future__ import annotations

import torch

from verispec.proposers.state_slots import _COMPACT_AFTER, StateSlots
from verispec.request import Request
from verispec.sampling_params import SamplingParams


class _Cache:
    def allocate(self) -> int:
        return 0

    def free(self, slot: int) -> None:
        pass


def test_an_idle_requests_states_are_kept_in_order_and_copied_out_of_each_steps_states():
    """A request that does not draft for a while keeps every state in position order, and after _COMPACT_AFTER
    steps holds one tensor of its own rows: it no longer keeps each step's whole batch of states alive."""
    slots = StateSlots()
    slots._init_slots(_Cache())
    r = Request("r", None, [1, 2, 3], SamplingParams(max_tokens=64))
    slots.add_request(r)
    steps = [torch.randn(4, 8) for _ in range(_COMPACT_AFTER + 3)]
    for step in steps:
        # row 1 of each step's batch is r's
        r.num_computed += 1
        slots.observe_hidden([r], [step[1:2]])
    pending = slots.pending["r"]
    assert len(pending) == 4
    # a copy of the first _COMPACT_AFTER rows, then views into the newest steps' states
    assert pending[0]._base is None and pending[-1]._base is steps[-1]
    assert torch.equal(torch.cat(pending), torch.stack([s[1] for s in steps]))
    assert slots.backlog(r) == len(steps)
