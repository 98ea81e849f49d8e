"""`eagle` / `eagle3`: an EAGLE draft model drafts from the target's own hidden states.

The draft is one position "ahead": its position p reads the token x_{p+1} and the target's state at p (EAGLE-1: the
final normed hidden state; EAGLE-3: the residual streams entering three layers, `aux_layers`). The engine hands the
proposer those states for every position a forward committed (`target_hidden = "all"`: prompt chunks, then the
accepted part of each verified step). At each step the draft first catches up on the pairs it
has not seen, up to the newest committed token, in one batched forward whose last position gives draft 1; each
further draft feeds back the previous draft token and the draft's own features. The draft's KV cache has one slot
per request; the positions written while drafting are speculative and are simply overwritten by the next catch-up
(O(1) rollback). Drafts are argmax picks (q one-hot for `probabilistic`, as in vLLM).
"""

from __future__ import annotations

import torch

from verispec.engine.kv_cache import KVCache
from verispec.engine.model_runner import ModelRunner, RowInput
from verispec.engine.request import Request
from verispec.spec.base import Proposal


class EagleProposer:
    target_hidden = "all"
    observes_states = False

    def __init__(self, draft: torch.nn.Module, runner: ModelRunner, aux_layers: tuple[int, ...] = ()):
        """draft: models/eagle.py's EagleDraft or models/eagle3.py's Eagle3Draft, bound to the target (embed,
        draft_ids); runner: the draft's cache and contexts; aux_layers: the target layers EAGLE-3 reads."""
        self.draft, self.runner, self.aux_layers = draft, runner, aux_layers
        self.cache: KVCache = runner.cache
        self.slot: dict[str, int] = {}
        self.computed: dict[
            str, int
        ] = {}  # draft positions whose K/V pair a committed token with a target state
        self.pending: dict[
            str, list[torch.Tensor]
        ] = {}  # target states of positions computed[rid].. not yet read

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

    def observe_hidden(self, reqs: list[Request], hidden: list[torch.Tensor]) -> None:
        for r, h in zip(reqs, hidden):  # h [n, H]: positions num_computed - n .. num_computed - 1, in order
            self.pending[r.request_id].append(h)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        k = max(k_max, default=0)
        if k == 0:
            return Proposal([[] for _ in reqs])
        rows, states = [], []
        for r in reqs:
            rid, end = r.request_id, r.num_computed  # the newest committed token sits at position `end`
            start = self.computed[rid]
            rows.append(
                RowInput(self.slot[rid], start, r.tokens_from(start + 1), logits_from=end - start - 1)
            )
            states.extend(self.pending[rid])
            self.pending[rid], self.computed[rid] = (
                [],
                end,
            )  # drafting writes past `end`: overwritten next time
        ids, positions, ctx, last = self.runner.build_context(rows)
        head_in, state = self.draft(self.draft.embed(ids), torch.cat(states), positions, ctx, self.cache.kv)
        state = state[last]  # [B, H] at each request's newest token
        token = self.draft.draft_ids(head_in[last])  # [B] draft 1
        drafts = [token]
        for i in range(1, k):  # draft i + 1 at position end + i from (draft i, the draft's own state)
            rows = [RowInput(self.slot[r.request_id], r.num_computed + i, [0]) for r in reqs]
            _, positions, ctx, _ = self.runner.build_context(rows)
            head_in, state = self.draft(self.draft.embed(token), state, positions, ctx, self.cache.kv)
            token = self.draft.draft_ids(head_in)
            drafts.append(token)
        ids = torch.stack(drafts, dim=1).tolist()  # [B, K]: the step's one host sync
        return Proposal([d[:c] for d, c in zip(ids, k_max)])

    def on_step_end(self, reqs, target, num_accepted) -> None:
        return None
