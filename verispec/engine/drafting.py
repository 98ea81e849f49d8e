"""A decode step's drafting: the planner asks, the proposer drafts, the planner keeps the drafts worth verifying.
The result is what the sampler verifies (chains, or one token tree per request), in batch order."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verispec.engine.options import EngineOptions
from verispec.engine.stop import length_left
from verispec.planner.goodput import schedule_cap
from verispec.proposers.base import Proposal, Proposer
from verispec.request import Request
from verispec.sample.constraints import has_position_constraints
from verispec.sample.metadata import SpecDecodeMetadata
from verispec.sample.tree import TokenTree, TreeBatch, batch_of

# (all requests, the speculating ones) -> per speculating request what its tokens are worth, or None (all 1)
WorthFn = Callable[[list[Request], list[Request]], list[float] | None]


@dataclass
class StepDrafts:
    # what the sampler verifies, per request in batch order
    spec: SpecDecodeMetadata
    # per request in batch order, its drafts' confidence (None: the proposer states none)
    confidence: list[list[float] | None] | None = None
    # the longest draft the planner asked for (0: the drafter was not called)
    longest_ask: int = 0
    # structured outputs: drafts cut because the grammar refused them, and drafts the grammar forced
    grammar_cut: int = 0
    grammar_forced: int = 0
    # with forced drafts: per request in batch order, how many of its drafts the proposer made (the planner learns
    # from those alone: forced ones are accepted far more often)
    proposed: list[int] | None = None


class Drafter:
    """Brings the proposer and the planner together for one decode step (`draft`)."""

    def __init__(self, proposer: Proposer | None, planner, opts: EngineOptions):
        self.proposer, self.planner, self.opts = proposer, planner, opts

    def draft(self, reqs: list[Request], worth_of: WorthFn) -> StepDrafts:
        b = len(reqs)
        spec = [r for r in reqs if r.speculate]
        ids = [r.request_id for r in spec]
        # an idle stretch's skipped step runs as a plain one: no drafter, no planning
        if not spec or self.planner.skips(ids):
            return StepDrafts(SpecDecodeMetadata.none(b))
        worth = worth_of(reqs, spec)
        k_step = schedule_cap(self.opts.spec_schedule, b, self.opts.num_speculative_tokens)
        caps = [self._cap(r, k_step) for r in spec]
        ask, prop, seconds = self._propose(spec, ids, caps, b, worth)
        longest = max(ask, default=0)
        if isinstance(prop.tree, TreeBatch) and prop.confidence is not None:
            prop = self._node_budget(ids, prop, b, seconds, worth)
            if prop.tree is None:
                # no node pays this step: nothing is verified
                return StepDrafts(SpecDecodeMetadata.none(b), longest_ask=longest)
        if prop.tree is not None:
            if self._tree_step_ok(reqs, spec, caps, prop.tree):
                tree = prop.tree if isinstance(prop.tree, TreeBatch) else batch_of(prop.tree, b)
                return StepDrafts(
                    SpecDecodeMetadata(prop.token_ids, prop.draft_probs, tree), prop.confidence, longest
                )
            prop = _top_path(prop)
        asked = [d[:c] for d, c in zip(prop.token_ids, ask)]
        one_hot = prop.draft_probs is None
        asked, cut = _grammar_cut(spec, asked, one_hot)
        lengths = self.planner.choose(ids, asked, prop.confidence, b, seconds, one_hot=one_hot, worth=worth)
        kept = {r.request_id: d[:n] for r, d, n in zip(spec, asked, lengths)}
        forced, proposed = 0, None
        if one_hot and any(r.grammar is not None for r in spec):
            made = {rid: len(d) for rid, d in kept.items()}
            forced = _grammar_forced(spec, kept, caps)
            proposed = [made.get(r.request_id, 0) for r in reqs] if forced else None
        drafts = [kept.get(r.request_id, []) for r in reqs]
        probs = None if one_hot else _align_draft_probs(reqs, spec, prop.draft_probs, drafts)
        confidence = None
        if prop.confidence is not None:
            conf = dict(zip(ids, prop.confidence))
            confidence = [conf.get(r.request_id) for r in reqs]
        return StepDrafts(SpecDecodeMetadata(drafts, probs), confidence, longest, cut, forced, proposed)

    def _propose(
        self, spec: list[Request], ids: list[str], caps: list[int], rows: int, worth: list[float] | None
    ) -> tuple[list[int], Proposal, float]:
        """The planner's ask, then the proposer's drafts for it -> (ask, proposal, drafting seconds)."""
        proposer, planner = self.proposer, self.planner
        # a drafter with a forward of its own first reads what was committed since it last drafted
        reads = planner.reads_backlog and proposer.needs.runs_forward
        backlog = [proposer.backlog(r) for r in spec] if reads else None
        left = [length_left(r, self.opts.max_model_len) for r in spec] if reads else None
        ask = planner.ask(ids, caps, rows, worth, backlog, left)
        t = time.perf_counter()
        # nothing asked of any request: the drafter is not called
        prop = proposer.propose(spec, ask) if any(ask) else Proposal([[] for _ in spec])
        seconds = time.perf_counter() - t
        if prop.hindsight is not None:
            planner.hindsight(ids, prop.hindsight)
        read = sum(backlog) - sum(proposer.backlog(r) for r in spec) if backlog else None
        planner.observe_draft_time(max(ask, default=0), seconds, read)
        return ask, prop, seconds

    def _cap(self, r: Request, k: int) -> int:
        """At most k drafts, and room for them and the step's own token within the request's (and the drafter's)
        length."""
        context = min(self.opts.max_model_len, self.opts.draft_max_model_len or 1 << 30)
        return max(0, min(k, length_left(r, context) - 1))

    def _node_budget(
        self, ids: list[str], prop: Proposal, rows: int, seconds: float, worth: list[float] | None
    ) -> Proposal:
        """A dynamic tree cut to the node count the planner finds pays this step (its most confident nodes), or no
        drafts at all (a Proposal without a tree) when none does."""
        tree = prop.tree
        n = self.planner.choose_nodes(
            ids, tree.host_parent, tree.host_depth, prop.confidence, rows, seconds, worth
        )
        if n == 0:
            return Proposal([[] for _ in ids])
        if n > tree.size:
            # the whole tree (fixed K)
            return prop
        return Proposal(
            [t[:n] for t in prop.token_ids], tree=tree.prefix(n), confidence=[c[:n] for c in prop.confidence]
        )

    def _tree_step_ok(
        self, reqs: list[Request], spec: list[Request], caps: list[int], tree: TokenTree | TreeBatch
    ) -> bool:
        """Whether this step can verify whole trees: every request speculates with room for the tree's depth, the
        trees fit the step's token budget, and no request needs position-dependent processing along a path
        (penalties, bad words, min_tokens still pending, logprobs): those steps verify the top-1 path instead."""
        if len(spec) != len(reqs) or min(caps) < tree.max_depth:
            return False
        if len(reqs) * (tree.size + 1) > max(self.opts.spec_token_budget, tree.size + 1):
            return False
        return not any(has_position_constraints(r) for r in reqs)


def _grammar_cut(spec: list[Request], drafts: list[list[int]], one_hot: bool) -> tuple[list[list[int]], int]:
    """Structured outputs: each draft cut where its request's grammar refuses a token (the target can never emit
    it) -> (drafts, tokens cut). One-hot drafts are cut before the refused token: the position then samples the
    target's masked law, which is what rejecting it would do. Drafts with a distribution keep the refused token as
    their last: rejecting it (certain: the target gives it 0) samples the residual max(0, p - q), and sampling p
    instead would bias the output towards the tokens q favours."""
    out, cut = [], 0
    for r, d in zip(spec, drafts):
        if r.grammar is not None and d:
            n = r.grammar.valid_prefix(d)
            n = n if one_hot or n == len(d) else n + 1
            cut += len(d) - n
            d = d[:n]
        out.append(d)
    return out, cut


def _grammar_forced(spec: list[Request], kept: dict[str, list[int]], caps: list[int]) -> int:
    """Structured outputs: where a request's grammar admits a single continuation after its drafts (a schema's
    keys, punctuation, the tail of an enum), those tokens are appended as drafts, free to propose and verified like
    any other (a model that spells them with other tokens rejects them). Within each request's cap; in place ->
    how many were appended."""
    added = 0
    for r, cap in zip(spec, caps):
        d = kept.get(r.request_id, [])
        if r.grammar is None or len(d) >= cap:
            continue
        more = r.grammar.forced(d)[: cap - len(d)]
        if more:
            kept[r.request_id] = d + more
            added += len(more)
    return added


def _top_path(prop: Proposal) -> Proposal:
    """A tree proposal's top-1 path as chains."""
    if isinstance(prop.tree, TreeBatch):
        return Proposal(prop.tree.top_chains(prop.token_ids))
    chain = prop.tree.chain
    # a sampled tree's first children are draws from q at their parents: q goes along
    probs = prop.draft_probs
    probs = None if probs is None else probs[:, [0] + chain[:-1]]
    return Proposal([[toks[i - 1] for i in chain] for toks in prop.token_ids], probs)


def _align_draft_probs(
    reqs: list[Request], spec: list[Request], probs: torch.Tensor, drafts: list[list[int]]
) -> torch.Tensor:
    """The speculating requests' draft probabilities [B_spec, K', V] -> [B, K, V] in batch order (zeros where a
    request has no draft there)."""
    k = max(len(d) for d in drafts) if drafts else 0
    if len(spec) == len(reqs) and probs.shape[1] == k:
        return probs
    idx = {r.request_id: i for i, r in enumerate(spec)}
    full = torch.zeros(len(reqs), k, probs.shape[-1], device=probs.device, dtype=probs.dtype)
    for b, r in enumerate(reqs):
        if r.request_id in idx and drafts[b]:
            full[b, : len(drafts[b])] = probs[idx[r.request_id], : len(drafts[b])]
    return full
