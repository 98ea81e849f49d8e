"""`ngram` (prompt lookup): drafts are the tokens that followed the longest earlier match of the context's suffix.

Each draft carries a confidence from the match's length (measured back past max_n): a suffix that matches the
earlier text for dozens of tokens is a span being copied, whose drafts are accepted far more often than those of a
bare max_n-token match. The planner calibrates it and verifies more drafts of long matches."""

from __future__ import annotations

from verispec.engine.request import Request
from verispec.spec.base import Proposal, ProposerNeeds
from verispec.spec.ngram import NgramIndex, match_confidence, match_length


class NgramProposer:
    needs = ProposerNeeds()

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        # per request, the n-gram index of its committed tokens (built at its first draft, extended at each next)
        self._index: dict[str, NgramIndex] = {}

    def add_request(self, req: Request) -> None:
        self._index[req.request_id] = NgramIndex(self.min_n, self.max_n)

    def remove_request(self, req: Request, aborted: bool) -> None:
        self._index.pop(req.request_id, None)

    def _context(self, req: Request) -> NgramIndex:
        index = self._index[req.request_id]
        n = len(index)
        # the prompt, then the output tokens committed since the last draft
        if n < req.num_prompt:
            index.extend(req.prompt_token_ids[n:])
            n = req.num_prompt
        if req.num_tokens > n:
            index.extend(req.output_token_ids[n - req.num_prompt :])
        return index

    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        drafts, confidence = [], []
        for r, k in zip(reqs, k_max):
            index = self._context(r) if k > 0 else None
            end = -1 if index is None else index.lookup()
            if end < 0:
                drafts.append([])
                confidence.append([])
                continue
            ctx = index.tokens
            draft = ctx[end + 1 : end + 1 + k]
            drafts.append(draft)
            confidence.append(match_confidence(match_length(ctx, end), len(draft)))
        return Proposal(drafts, confidence=confidence)
