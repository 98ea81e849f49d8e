"""Draft heads on the target's own hidden state: `medusa` and `mlp_speculator`.

The engine hands the proposer, after every step, the target's final normed hidden state at the position that
produced each request's newest token (`observe_hidden`); `propose` runs the heads on those states and the newest
tokens. The heads are models in `verispec/models/` (`medusa.py`, `mlp_speculator.py`) with one call,
`heads(hidden [B, H], last_tokens [B], k) -> draft ids [B, k]`. Drafts are argmax picks, so they are deterministic:
`probabilistic` verification treats q as one-hot at the draft (the law they were actually drawn from, which keeps it
lossless), and no draft probabilities are kept.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.proposers.base import Proposal, ProposerNeeds, asked, scatter
from verispec.request import Request


class HeadProposer:
    needs = ProposerNeeds(target_hidden="last", runs_forward=True)

    def __init__(self, heads: nn.Module):
        self.heads = heads
        self.dtype = next(heads.parameters()).dtype
        # request id -> [H] state at its newest committed token
        self.hidden: dict[str, torch.Tensor] = {}

    def add_request(self, req: Request) -> None:
        return None

    def remove_request(self, req: Request, aborted: bool) -> None:
        self.hidden.pop(req.request_id, None)

    def backlog(self, req: Request) -> int:
        # the heads read only the newest state
        return 0

    def observe_hidden(self, reqs: list[Request], hidden: list[torch.Tensor]) -> None:
        """hidden[b] [1, H]: the target's final normed state whose logits gave reqs[b]'s newest token."""
        for r, h in zip(reqs, hidden):
            self.hidden[r.request_id] = h[-1]

    @torch.inference_mode()
    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        k = max(k_max, default=0)
        if k == 0:
            return Proposal([[] for _ in reqs])
        live = asked(k_max)
        if live is None:
            return self._draft(reqs, k_max, k)
        return scatter(self._draft([reqs[i] for i in live], [k_max[i] for i in live], k), live, len(reqs))

    def _draft(self, reqs: list[Request], k_max: list[int], k: int) -> Proposal:
        # [B, H]
        x = torch.stack([self.hidden[r.request_id] for r in reqs]).to(self.dtype)
        # [B]
        last = torch.tensor([r.last_token_id for r in reqs], device=x.device)
        # [B, K]
        ids = self.heads(x, last, k)
        # the step's one host sync
        return Proposal([d[:c] for d, c in zip(ids.tolist(), k_max)])
