"""`dflash`: a DFlash draft (models/dflash.py) drafts a whole block in one forward from the target's hidden states.

The engine hands the proposer the target's aux streams (`aux_layers`: the streams after the checkpoint's target
layers) for every position a forward committed (`target_hidden = "all"`: prompt chunks, then the accepted part of
each verified step). At each step the proposer first writes the context K/V of the positions it has not seen into the
draft's KV cache (one batched pass, no attention), then runs one forward over each request's block: its newest
committed token followed by k mask tokens, at positions end .. end + k. The k drafts are the argmax at the mask
positions (q one-hot for `probabilistic`, as in vLLM). The block's K/V written past `end` are speculative and simply
overwritten by the next step's context (O(1) rollback, one cache slot per request).
"""

from __future__ import annotations

import torch

from verispec.models.dflash import DFlashDraft
from verispec.proposers.base import Proposal, ProposerNeeds, argmax_drafts
from verispec.proposers.state_slots import StateSlots
from verispec.request import Request
from verispec.runner.model_runner import ModelRunner, RowInput


class DFlashProposer(StateSlots):
    def __init__(self, draft: DFlashDraft, runner: ModelRunner, mask_token: int):
        """draft: bound to the target (embedding, LM head); runner: the draft's cache and contexts; mask_token: the
        id the masked block positions are fed as (`dflash_config.mask_token_id`)."""
        self.draft, self.runner, self.mask_token = draft, runner, mask_token
        self.causal = draft.dflash.causal
        self.needs = ProposerNeeds(target_hidden="all", aux_layers=draft.dflash.aux_layers, runs_forward=True)
        self._init_slots(runner.cache)

    def _write_context(self, reqs: list[Request]) -> None:
        """The context K/V of every pending target state, all requests in one pass."""
        rows, states = [], []
        for r in reqs:
            rid = r.request_id
            if not self.pending[rid]:
                continue
            n = sum(h.shape[0] for h in self.pending[rid])
            start = self.computed[rid]
            # the states cover every committed position before the newest token
            assert start + n == r.num_computed, (rid, start, n, r.num_computed)
            rows.append(RowInput(self.slot[rid], start, [0] * n))
            states.extend(self.pending[rid])
            self.pending[rid], self.computed[rid] = [], start + n
        if rows:
            _, positions, ctx, _ = self.runner.build_context(rows)
            self.draft.write_context(torch.cat(states), positions, ctx, self.cache.kv)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        if max(k_max, default=0) == 0:
            return Proposal([[] for _ in reqs])
        # a request not asked keeps its states for its next draft
        self._write_context([r for r, k in zip(reqs, k_max) if k > 0])
        rows = []
        for r, k in zip(reqs, k_max):
            if k == 0:
                continue
            # the newest committed token at position end, then k masks; logits at the masks
            tokens = [r.last_token_id] + [self.mask_token] * k
            block = None if self.causal else torch.ones(k + 1, k + 1, dtype=torch.bool)
            rows.append(
                RowInput(self.slot[r.request_id], r.num_computed, tokens, logits_from=1, tree_mask=block)
            )
        ids, positions, ctx, flat = self.runner.build_context(rows)
        head_in = self.draft(self.draft.embed(ids), positions, ctx, self.cache.kv)
        return argmax_drafts(self.draft, head_in, flat, k_max)
