"""`dspark`: a DSpark draft (models/dspark.py) drafts a block in one forward, then its Markov head picks the drafts
left to right.

Context as for DFlash (proposers/dflash.py): the target's states of every committed position become the draft's
context K/V. A step runs one forward over each request's block (the newest committed token, then the noise tokens;
DFlash's anchor + k masks with `dspark_bonus_anchor`) and takes its k draft rows; the sequential stage then adds the
Markov bias of each previous pick to the base logits, one position at a time, for every request at once. Drafts are
argmax picks (q one-hot for `probabilistic`). The confidence head's estimates go to the goodput planner (each
draft's chance of acceptance if the ones before it were accepted), and `dspark_confidence_threshold` cuts a block
where their running product falls below it, as vLLM does.
"""

from __future__ import annotations

import torch

from verispec.models.dspark import DSparkDraft
from verispec.proposers.base import Proposal
from verispec.proposers.dflash import DFlashProposer
from verispec.request import Request
from verispec.runner.model_runner import ModelRunner, RowInput


class DSparkProposer(DFlashProposer):
    def __init__(self, draft: DSparkDraft, runner: ModelRunner, mask_token: int, threshold: float = 0.0):
        """threshold: `dspark_confidence_threshold` (0: no cut)."""
        super().__init__(draft, runner, mask_token)
        self.threshold = threshold

    @torch.inference_mode()
    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        if max(k_max, default=0) == 0:
            return Proposal([[] for _ in reqs])
        self._write_context([r for r, k in zip(reqs, k_max) if k > 0])
        live = [(r, k) for r, k in zip(reqs, k_max) if k > 0]
        # anchor + k - 1 noise tokens, every row a draft; the bonus-anchor layout: anchor + k masks, drafts at masks
        extra = 1 if self.draft.spark.bonus_anchor else 0
        rows = []
        for r, k in live:
            tokens = [r.last_token_id] + [self.mask_token] * (k - 1 + extra)
            block = torch.ones(len(tokens), len(tokens), dtype=torch.bool)
            rows.append(
                RowInput(self.slot[r.request_id], r.num_computed, tokens, logits_from=extra, tree_mask=block)
            )
        ids, positions, ctx, flat = self.runner.build_context(rows)
        head_in = self.draft(self.draft.embed(ids), positions, ctx, self.cache.kv)
        kmax = max(k for _, k in live)
        # [B, kmax] each request's draft rows, its last one repeated past its own k
        at, index = 0, []
        for _, k in live:
            index.append([flat[at + min(i, k - 1)] for i in range(kmax)])
            at += k
        idx = torch.tensor(index, dtype=torch.long, device=head_in.device)
        # [B, kmax, H]
        hidden = head_in[idx]
        base = self.draft.draft_logits(hidden.reshape(-1, hidden.shape[-1])).view(len(live), kmax, -1)
        anchor = torch.tensor([r.last_token_id for r, _ in live], device=head_in.device)
        drafts, conf = self.draft.sample_block(hidden, base, anchor)
        # the step's one host sync
        host_drafts = drafts.tolist()
        host_conf = conf.double().tolist() if conf is not None else None
        out, confidence = {}, {}
        for b, (r, k) in enumerate(live):
            c = host_conf[b][:k] if host_conf is not None else None
            n = _kept(c, self.threshold) if c is not None else k
            out[r.request_id] = host_drafts[b][:n]
            confidence[r.request_id] = c[:n] if c is not None else None
        token_ids = [out.get(r.request_id, []) for r in reqs]
        if host_conf is None:
            return Proposal(token_ids)
        return Proposal(token_ids, confidence=[confidence.get(r.request_id) or [] for r in reqs])


def _kept(conf: list[float], threshold: float) -> int:
    """The leading drafts whose running product of confidences stays at or above threshold."""
    survival, n = 1.0, 0
    for c in conf:
        survival *= c
        if survival < threshold:
            break
        n += 1
    return n
