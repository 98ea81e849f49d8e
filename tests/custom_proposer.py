"""A team's own drafter, as `method: "custom_class"` loads one: a plain class against the Proposer protocol of
verispec/proposers/base.py, named by its import path (`"model": "tests.custom_proposer.RepeatLastToken"`). Used by
tests/e2e/proposers/test_custom_class.py and the method conformance tests."""

from __future__ import annotations

from verispec.proposers.base import DraftContext, Proposal, ProposerNeeds
from verispec.request import Request
from verispec.spec_config import SpeculativeConfig


class RepeatLastToken:
    """Drafts the request's newest token, k_max times: right on runs of one token, wrong elsewhere."""

    # tokens only: no target states, no forward of its own
    needs = ProposerNeeds()

    def __init__(self, config: SpeculativeConfig, context: DraftContext):
        self.k = config.num_speculative_tokens
        self.live: set[str] = set()

    def add_request(self, req: Request) -> None:
        self.live.add(req.request_id)

    def remove_request(self, req: Request, aborted: bool) -> None:
        self.live.discard(req.request_id)

    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        assert all(r.request_id in self.live for r in reqs)
        return Proposal([[r.last_token_id] * min(k, self.k) for r, k in zip(reqs, k_max)])
