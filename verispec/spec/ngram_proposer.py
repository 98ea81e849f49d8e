"""`ngram` (prompt lookup): drafts are the tokens that followed the longest earlier match of the context's suffix.

Each draft carries a confidence from the match's length (measured back past max_n): a suffix that matches the
earlier text for dozens of tokens is a span being copied, whose drafts are accepted far more often than those of a
bare max_n-token match. The planner calibrates it and verifies more drafts of long matches."""

from __future__ import annotations

import numpy as np

from verispec.engine.request import Request
from verispec.spec.base import Proposal, ProposerNeeds
from verispec.spec.ngram import match_confidence, match_length, ngram_lookup


class NgramProposer:
    needs = ProposerNeeds()

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        # growing int32 buffer per request (amortised appends)
        self._ctx: dict[str, np.ndarray] = {}
        self._len: dict[str, int] = {}

    def add_request(self, req: Request) -> None:
        buf = np.zeros(max(64, 2 * req.num_prompt), dtype=np.int32)
        buf[: req.num_prompt] = req.prompt_token_ids
        self._ctx[req.request_id], self._len[req.request_id] = buf, req.num_prompt

    def remove_request(self, req: Request, aborted: bool) -> None:
        self._ctx.pop(req.request_id, None)
        self._len.pop(req.request_id, None)

    def _context(self, req: Request) -> np.ndarray:
        rid = req.request_id
        buf, n = self._ctx[rid], self._len[rid]
        total = req.num_tokens
        # append the newly committed output tokens
        if total > n:
            if total > len(buf):
                buf = np.resize(buf, 2 * total)
                self._ctx[rid] = buf
            buf[n:total] = req.output_token_ids[n - req.num_prompt :]
            self._len[rid] = total
        return buf[:total]

    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        drafts, confidence = [], []
        for r, k in zip(reqs, k_max):
            ctx = self._context(r) if k > 0 else None
            end = -1 if ctx is None else ngram_lookup(ctx, self.min_n, self.max_n)
            if end < 0:
                drafts.append([])
                confidence.append([])
                continue
            draft = ctx[end + 1 : end + 1 + k].tolist()
            drafts.append(draft)
            confidence.append(match_confidence(match_length(ctx, end), len(draft)))
        return Proposal(drafts, confidence=confidence)
