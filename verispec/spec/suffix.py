"""`suffix` decoding: drafts from suffix trees over the request's own prompt/output and over past responses."""

from __future__ import annotations

from verispec.engine.request import Request
from verispec.spec.base import Proposal, ProposerNeeds
from verispec.spec.suffix_tree import SuffixDecodingCache


class SuffixProposer:
    needs = ProposerNeeds()

    def __init__(
        self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float
    ):
        self.cache = SuffixDecodingCache(max_tree_depth, max_cached_requests, max_spec_factor, min_token_prob)
        self.depth = max_tree_depth
        # output tokens already appended to the request's tree
        self._seen: dict[str, int] = {}

    def add_request(self, req: Request) -> None:
        self.cache.start_request(req.request_id, req.prompt_token_ids)
        self._seen[req.request_id] = 0

    def remove_request(self, req: Request, aborted: bool) -> None:
        if self._seen.pop(req.request_id, None) is None:
            return
        self._sync(req)
        if aborted:
            self.cache.abort_request(req.request_id)
        else:
            self.cache.stop_request(req.request_id)

    def _sync(self, req: Request) -> None:
        seen = self._seen.get(req.request_id, 0)
        if len(req.output_token_ids) > seen:
            self.cache.add_active_response(req.request_id, req.output_token_ids[seen:])
            self._seen[req.request_id] = len(req.output_token_ids)

    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        drafts, confidence = [], []
        for r, k in zip(reqs, k_max):
            if k <= 0:
                drafts.append([])
                confidence.append([])
                continue
            # the request's new tokens join its trees when it drafts next (or when it finishes)
            self._sync(r)
            draft = self.cache.speculate(r.request_id, r.tail(self.depth), k)
            drafts.append(draft.token_ids)
            confidence.append(conditional_probs(draft.probs))
        return Proposal(drafts, confidence=confidence)


def conditional_probs(probs: list[float]) -> list[float]:
    """Running probabilities of a draft's prefixes -> each token's probability given the ones before it."""
    out, prev = [], 1.0
    for p in probs:
        out.append(p / prev if prev > 0 else 0.0)
        prev = p
    return out
