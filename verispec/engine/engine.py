"""The step loop: admission, prefill / decode scheduling, proposing, verifying, committing, stopping."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from itertools import accumulate

import torch

from verispec.engine.stop import commit_tokens, length_left, logprob_entry, may_end_early
from verispec.metrics import EngineCounters, SpecDecodingLogging, SpecDecodingStats
from verispec.outputs import CompletionOutput, RequestOutput, SpecDecodeMetrics
from verispec.planner.goodput import DraftPlanner, chance_to_run, schedule_cap
from verispec.proposers.base import Proposal, Proposer, ProposerNeeds
from verispec.request import Request, Status
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner, RowInput
from verispec.sample import logits as S
from verispec.sample.constraints import constrain_tokens, has_position_constraints, set_token_constraints
from verispec.sample.logits import make_generator, sample_key
from verispec.sample.metadata import SpecDecodeMetadata, VerifyRule
from verispec.sample.step import position_uniforms_of, sample_step
from verispec.sample.tree import TokenTree, TreeBatch, batch_of, tree_accept
from verispec.sample.tree_verify import tree_rejection_sample
from verispec.sample.verify import draw_uniform
from verispec.tokenizer import IncrementalDetokenizer


@dataclass
class EngineOptions:
    max_model_len: int
    max_num_batched_tokens: int = 1024
    num_speculative_tokens: int = 0
    verify: VerifyRule = VerifyRule()
    disable_by_batch_size: int | None = None
    log_interval_s: float = 10.0
    # Most tokens one decode step may score (committed + drafts). Verifying more rows than this turns the
    # forward compute-bound (on a CPU from ~32 rows), so at large batch each request gets fewer drafts.
    spec_token_budget: int = 32
    # speculative_config.max_model_len: no drafts past this length
    draft_max_model_len: int | None = None
    # num_speculative_tokens_per_batch_size: [(start_bs, end_bs, K), ...], K by decode batch size
    spec_schedule: tuple[tuple[int, int, int], ...] | None = None


@dataclass(frozen=True)
class SchedulerStats:
    """Request and KV-slot counts at one moment (the server's /health and gauges read these)."""

    running: int
    waiting: int
    free_kv_slots: int
    num_kv_slots: int


def fit_budget(drafts: list[list[int]], allowance: int) -> list[list[int]]:
    """Trim drafts so that their total length is at most `allowance`, sharing it evenly (short drafts first)."""
    if sum(len(d) for d in drafts) <= allowance:
        return drafts
    out = [d for d in drafts]
    order = sorted(range(len(drafts)), key=lambda i: len(drafts[i]))
    left = max(0, allowance)
    for n, i in enumerate(order):
        take = min(len(drafts[i]), left // (len(order) - n))
        out[i] = drafts[i][:take]
        left -= take
    return out


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        opts: EngineOptions,
        proposer: Proposer | None,
        eos_token_ids: tuple[int, ...],
        seed: int = 0,
        planner: DraftPlanner | None = None,
    ):
        """planner: the goodput planner choosing each step's draft lengths (None: fixed K, fit to
        spec_token_budget)."""
        self.runner, self.tokenizer, self.opts, self.proposer = runner, tokenizer, opts, proposer
        self.planner = planner if proposer is not None else None
        self.cache: KVCache = runner.cache
        self.eos_token_ids = eos_token_ids
        self.device = runner.device
        self.generator = make_generator(seed, self.device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # requests join only between runs (LLM.generate sets it): once none wait, the running batch is all the work
        # left, and the planner weighs a token by the time it saves that batch (DraftPlanner.token_worth)
        self.closed = False
        # requests that could end before their length (EOS, stop rules) and finished: how many did, and the tokens
        # they committed (the early-end rate a closed batch's plan reads: chance_to_run)
        self.early_ends = 0
        self.early_exposure = 0
        self.requests: dict[str, Request] = {}
        k = opts.num_speculative_tokens if proposer is not None else 0
        self.counters = EngineCounters(num_spec_tokens=k, spec=SpecDecodingStats(k) if proposer else None)
        self.spec_log = SpecDecodingLogging(k, opts.log_interval_s) if proposer else None
        if self.spec_log is not None and self.planner is not None:
            self.spec_log.extra = self._planner_log

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_token_ids) >= self.opts.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum model length "
                f"of {self.opts.max_model_len}. Make sure that `max_model_len` is no smaller than the number of "
                "text tokens."
            )
        vocab = self.runner.model.cfg.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        params.check_vocab(vocab)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True was given)")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer (skip_tokenizer_init=True was given)")
        req = Request(request_id, prompt, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids)
        set_token_constraints(req, self.tokenizer, vocab, self.device)
        if params.seed is not None:
            req.generator = make_generator(params.seed, self.device)
            req.sample_key = sample_key(params.seed)
        else:
            g = self.generator
            req.sample_key = int(torch.randint(-(1 << 63), (1 << 63) - 1, (), generator=g, device=g.device))
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, params.skip_special_tokens
            )
        limit = self.opts.disable_by_batch_size
        req.speculate = self.proposer is not None and (
            limit is None or len(self.waiting) + len(self.running) < limit
        )
        if params.logprobs is not None:
            req.logprobs = []
        self.requests[request_id] = req
        self.waiting.append(req)
        self.counters.prompt_tokens += len(prompt_token_ids)
        return req

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        req.finish_reason = "abort"
        self._finish(req, aborted=True)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.cache.num_free, self.cache.num_slots)

    def running_request_ids(self) -> list[str]:
        """The requests the next step runs (the ones a failed step is blamed on)."""
        return [r.request_id for r in self.running]

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        self._admit()
        if not self.running:
            return []
        prefill = [r for r in self.running if r.in_prefill]
        c, t0, n0 = self.counters, time.perf_counter(), self.counters.generation_tokens
        if prefill:
            touched = self._prefill(prefill)
            c.prefill_seconds += time.perf_counter() - t0
        else:
            touched = self._decode(list(self.running))
            c.decode_seconds += time.perf_counter() - t0
            c.decode_tokens += c.generation_tokens - n0
        if self.spec_log is not None:
            self.spec_log.maybe_log()
        return [self.output_of(r) for r in touched]

    def _admit(self) -> None:
        while self.waiting and self.cache.num_free:
            req = self.waiting.popleft()
            req.slot = self.cache.allocate()
            req.status = Status.RUNNING
            self.running.append(req)
            if self.proposer is not None:
                self.proposer.add_request(req)

    def _prefill(self, reqs: list[Request]) -> list[Request]:
        """Chunked prefill of waiting prompts; one padded forward over the chosen requests."""
        reqs = sorted(reqs, key=lambda r: r.slot)
        budget = self.opts.max_num_batched_tokens
        rows, chosen = [], []
        for r in reqs:
            n = min(r.num_prompt - r.num_computed, budget)
            if n <= 0 or (rows and self._padding_waste(rows, r, n)):
                break
            final = r.num_computed + n == r.num_prompt
            # logits for every position of the chunk
            every = r.params.prompt_logprobs is not None
            rows.append(
                RowInput(
                    r.slot,
                    r.num_computed,
                    r.prompt_token_ids[r.num_computed : r.num_computed + n],
                    logits_from=0 if every else n - 1 if final else n,
                )
            )
            chosen.append(r)
            budget -= n
        out, states = self._forward(chosen, rows)
        # at: the logits row of this request's first returned position
        finals, last_rows, at = [], [], 0
        for r, row in zip(chosen, rows):
            n_rows = len(row.token_ids) - row.logits_from
            if r.params.prompt_logprobs is not None:
                self._add_prompt_logprobs(r, out.logits[at : at + n_rows])
            r.num_computed += len(row.token_ids)
            if not r.in_prefill:
                finals.append(r)
                last_rows.append(at + n_rows - 1)
            at += n_rows
        if finals:
            logits = out.logits if len(last_rows) == at else out.logits[last_rows]
            step = sample_step(finals, logits, SpecDecodeMetadata.none(len(finals)), VerifyRule())
            self._commit(finals, step.tokens, step)
        # every prompt position of every chunk
        if states is not None:
            sizes = [len(row.token_ids) for row in rows]
            starts = accumulate(sizes, initial=0)
            self._observe_hidden(chosen, states, [range(s, s + n) for s, n in zip(starts, sizes)])
        elif finals:
            self._observe_hidden(finals, out.hidden, [range(i, i + 1) for i in last_rows])
        return finals

    def _forward(self, reqs: list[Request], rows: list[RowInput]):
        """One target forward over rows (row b is reqs[b]'s). -> (its output, the states a proposer with
        target_hidden "all" drafts from for every token fed [tokens, D]: the final normed hidden, or its aux layers'
        streams side by side (EAGLE-3); else None). A proposer that observes states (extract_hidden_states) gets
        its aux layers' states of every token fed."""
        needs = self.proposer.needs if self.proposer is not None else ProposerNeeds()
        every = needs.observes_states
        want_all = needs.target_hidden == "all"
        aux = needs.aux_layers
        out = self.runner.run(
            rows, aux, aux_all=every or (want_all and bool(aux)), hidden_all=want_all and not aux
        )
        if every:
            # [tokens, len(aux_layers), H]
            stacked = out.aux_hidden.view(out.aux_hidden.shape[0], -1, out.hidden.shape[-1])
            sizes = [len(r.token_ids) for r in rows]
            self.proposer.observe_states(reqs, [r.token_ids for r in rows], list(stacked.split(sizes)))
        if not want_all:
            return out, None
        return out, (out.aux_hidden if aux else out.hidden_all)

    def _observe_hidden(
        self, reqs: list[Request], hidden: torch.Tensor, rows: list[range] | list[list[int]]
    ) -> None:
        """Hand a proposer that drafts from the target's state the rows of `hidden` for the positions this forward
        committed, per live request in position order, the last one behind the newest token (target_hidden "all"),
        or that last row alone ("last": Medusa, MLP speculator). A range of rows is handed over as a view (no copy,
        no index tensor); a list (a tree's path) is gathered."""
        p = self.proposer
        if p is None or p.needs.target_hidden == "none":
            return
        live = [
            (r, idx[-1:] if p.needs.target_hidden == "last" else idx)
            for r, idx in zip(reqs, rows)
            if not r.finished
        ]
        if live:
            dev, n = hidden.device, hidden.shape[0]
            # a range over every row (batch 1 without drafts) is the tensor itself: even a view costs tens of
            # microseconds right after a forward, whose weights have streamed through the caches
            picked = [
                (hidden if i.start == 0 and i.stop == n else hidden[i.start : i.stop])
                if isinstance(i, range)
                else hidden[torch.tensor(i, device=dev)]
                for _, i in live
            ]
            p.observe_hidden([r for r, _ in live], picked)

    def _add_prompt_logprobs(self, r: Request, logits: torch.Tensor) -> None:
        """logits [n, V] of the chunk r.num_computed.. (not yet advanced): row i scores prompt token
        num_computed + i + 1 (the last prompt row scores the first output token, sampled, not a prompt logprob)."""
        start = r.num_computed
        targets = r.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]]
        if r.prompt_logprobs is None:
            # the first prompt token has no context
            r.prompt_logprobs = [None]
        if not targets:
            return
        k = r.params.prompt_logprobs
        lp = S.compute_logprobs(
            logits[: len(targets)], torch.tensor(targets, device=logits.device), max(k, 1)
        )
        r.prompt_logprobs.extend(logprob_entry(r, lp, i, t, k) for i, t in enumerate(targets))

    def _padding_waste(self, rows: list[RowInput], r: Request, n: int) -> bool:
        span = max(max(x.slot for x in rows), r.slot) - min(min(x.slot for x in rows), r.slot) + 1
        q = max(max(len(x.token_ids) for x in rows), n)
        real = sum(len(x.token_ids) for x in rows) + n
        return span * q > 2 * real + 64

    def _decode(self, reqs: list[Request]) -> list[Request]:
        drafts = [[] for _ in reqs]
        draft_probs = confidence = None
        spec = [r for r in reqs if r.speculate]
        planner = self.planner
        ids = [r.request_id for r in spec]
        # drafts asked of each speculating request (none where nothing is drafted)
        ask: list[int] = []
        # an idle stretch's skipped step runs as a plain one: no drafter, no planning
        if spec and self.proposer is not None and (planner is None or not planner.skips(ids)):
            worth = self._token_worth(reqs, spec)
            k_step = schedule_cap(self.opts.spec_schedule, len(reqs), self.opts.num_speculative_tokens)
            caps = [self._draft_cap(r, k_step) for r in spec]
            # a drafter with a forward of its own first reads what was committed since it last drafted
            reads = planner is not None and self.proposer.needs.runs_forward
            backlog = [self.proposer.backlog(r) for r in spec] if reads else None
            left = [length_left(r, self.opts.max_model_len) for r in spec] if reads else None
            ask = caps if planner is None else planner.ask(ids, caps, len(reqs), worth, backlog, left)
            t = time.perf_counter()
            # nothing asked of any request: the drafter is not called
            prop = self.proposer.propose(spec, ask) if any(ask) else Proposal([[] for _ in spec])
            draft_seconds = time.perf_counter() - t
            if planner is not None:
                read = sum(backlog) - sum(self.proposer.backlog(r) for r in spec) if backlog else None
                planner.observe_draft_time(max(ask, default=0), draft_seconds, read)
            # a dynamic tree's node budget: its most confident nodes that pay (none: this step drafts nothing)
            no_drafts = False
            if planner is not None and isinstance(prop.tree, TreeBatch) and prop.confidence is not None:
                prop = self._node_budget(planner, spec, prop, len(reqs), draft_seconds, worth)
                no_drafts = prop.tree is None
            if prop.tree is not None:
                if self._tree_step_ok(reqs, spec, caps, prop.tree):
                    return self._decode_tree(reqs, prop)
                # this step verifies the tree's top-1 path as a chain
                if isinstance(prop.tree, TreeBatch):
                    prop = Proposal(prop.tree.top_chains(prop.token_ids))
                else:
                    chain = prop.tree.chain
                    # a sampled tree's first children are draws from q at their parents: q goes along
                    probs = prop.draft_probs
                    probs = None if probs is None else probs[:, [0] + chain[:-1]]
                    prop = Proposal([[toks[i - 1] for i in chain] for toks in prop.token_ids], probs)
            asked = [d[:c] for d, c in zip(prop.token_ids, ask)]
            if planner is None:
                kept = fit_budget(asked, self.opts.spec_token_budget - len(reqs))
            elif no_drafts:
                kept = asked
            else:
                lengths = planner.choose(
                    ids,
                    asked,
                    prop.confidence,
                    len(reqs),
                    draft_seconds,
                    one_hot=prop.draft_probs is None,
                    worth=worth,
                )
                kept = [d[:n] for d, n in zip(asked, lengths)]
                if prop.confidence is not None:
                    conf_by_id = dict(zip(ids, prop.confidence))
                    confidence = [conf_by_id.get(r.request_id) for r in reqs]
            by_id = {r.request_id: d for r, d in zip(spec, kept)}
            drafts = [by_id.get(r.request_id, []) for r in reqs]
            if prop.draft_probs is not None:
                draft_probs = self._align_draft_probs(reqs, spec, prop.draft_probs, drafts)
        rows = [RowInput(r.slot, r.num_computed, [r.last_token_id] + d) for r, d in zip(reqs, drafts)]
        t = time.perf_counter()
        out, states = self._forward(reqs, rows)
        step = sample_step(reqs, out.logits, SpecDecodeMetadata(drafts, draft_probs), self.opts.verify)
        if planner is not None:
            # step.num_accepted is on the host: the step's work is done
            n_rows = sum(len(row.token_ids) for row in rows)
            planner.step_cost.observe(n_rows, time.perf_counter() - t, drafted=any(drafts))
            planner.observe_step(len(reqs) + sum(step.num_accepted), n_rows, max(ask, default=0), len(reqs))
        # the step's spec-decode counts, only when it verified drafts (a step without any adds nothing)
        stats = None
        for b, (r, d, n) in enumerate(zip(reqs, drafts, step.num_accepted)):
            # roll back the rejected drafts: O(1)
            r.num_computed += 1 + n
            r.decode_steps += 1
            if d:
                r.num_draft_tokens += len(d)
                r.num_accepted_tokens += n
                r.spec_steps.append((len(d), n))
                stats = stats or SpecDecodingStats(self.opts.num_speculative_tokens)
                stats.observe_draft(len(d), n)
                if planner is not None:
                    planner.observe(
                        r.request_id, len(d), n, confidence[b] if confidence else None, step.tokens[b]
                    )
            elif planner is not None:
                # drafts it did not verify are judged against the token it commits
                planner.committed(r.request_id, step.tokens[b])
        if stats is not None:
            self.counters.spec.add(stats)
            self.spec_log.observe(stats)
        if planner is not None:
            self.counters.mean_chosen_k = planner.mean_chosen_k
            self.counters.verified_row_cost = planner.verified_row_cost()
        self._commit(reqs, step.tokens, step)
        if self.proposer is not None and self.proposer.needs.target_hidden != "none":
            # each request's first scored row
            starts = accumulate((1 + len(d) for d in drafts), initial=0)
            rows_of = [range(s, s + 1 + n) for s, n in zip(starts, step.num_accepted)]
            self._observe_hidden(reqs, out.hidden if states is None else states, rows_of)
        return reqs

    def _planner_log(self) -> str:
        p = self.planner
        return (
            f", Planner: mean chosen K {p.mean_chosen_k:.2f}, verified row cost {p.verified_row_cost():.2f}"
        )

    def _token_worth(self, reqs: list[Request], spec: list[Request]) -> list[float] | None:
        """Per speculating request, what its tokens are worth to a closed batch (DraftPlanner.token_worth). Each
        request ends at its length limit after as many steps as its tokens left take at its commit rate so far
        (a request whose drafts keep being accepted is not the one the batch waits for, though it has as many
        tokens left); weighed by the chance that every request that may end earlier (EOS, stop rules) runs that
        long, from the early ends seen so far (chance_to_run). None where finished requests' slots may be
        refilled."""
        # a batch of one: each of its tokens is worth a whole step, as in an open batch
        if self.planner is None or not spec or not self.closed or self.waiting or len(reqs) == 1:
            return None
        left = [max(1, length_left(r, self.opts.max_model_len)) for r in reqs]
        steps = [math.ceil(n / r.tokens_per_step()) for r, n in zip(reqs, left)]
        early = [(r, n) for r, n in zip(reqs, left) if may_end_early(r)]
        runs = 1.0
        if early:
            exposure = self.early_exposure + sum(len(r.output_token_ids) for r, _ in early)
            # every one of them: otherwise the request the batch waits for is any whose EOS comes late
            runs = chance_to_run(sum(n for _, n in early), self.early_ends, exposure)
        worth = self.planner.token_worth(steps, runs)
        # every token worth 1 (a lockstep start, a batch of one): the open batch's plan
        if min(worth) == 1.0:
            return None
        by_id = dict(zip((r.request_id for r in reqs), worth))
        return [by_id[r.request_id] for r in spec]

    def _node_budget(
        self,
        planner: DraftPlanner,
        spec: list[Request],
        prop: Proposal,
        rows: int,
        draft_seconds: float,
        worth: list[float] | None,
    ) -> Proposal:
        """A dynamic tree cut to the node count the planner finds pays this step (its most confident nodes), or no
        drafts at all (a Proposal without a tree) when none does."""
        tree = prop.tree
        n = planner.choose_nodes(
            [r.request_id for r in spec],
            tree.host_parent,
            tree.host_depth,
            prop.confidence,
            rows,
            draft_seconds,
            worth,
        )
        if n == 0:
            return Proposal([[] for _ in spec])
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

    def _decode_tree(self, reqs: list[Request], prop: Proposal) -> list[Request]:
        """Verify a token tree per request in one forward: walk it with the target's own picks (tree_accept), or, under
        `probabilistic` with random requests, by recursive rejection sampling against the drafter's probabilities
        (tree_rejection_sample); make the accepted path's K/V contiguous; commit."""
        b = len(reqs)
        tree = prop.tree if isinstance(prop.tree, TreeBatch) else batch_of(prop.tree, b)
        n = tree.size + 1
        # [B][1 + N]
        nodes = [[r.last_token_id] + toks for r, toks in zip(reqs, prop.token_ids)]
        depth_l = tree.depth.tolist()
        rows = [
            RowInput(r.slot, r.num_computed, t, tree_mask=tree.ancestors[i], depths=depth_l[i])
            for i, (r, t) in enumerate(zip(reqs, nodes))
        ]
        t = time.perf_counter()
        out, states = self._forward(reqs, rows)
        v = out.logits.shape[-1]
        logits = out.logits.view(b, n, v)
        if any(r.disallowed is not None or r.logit_bias_ids is not None for r in reqs):
            logits = logits.clone()
            # position-independent: allowed ids, logit bias
            constrain_tokens(
                logits,
                reqs,
                [[] for _ in reqs],
            )
        flat = logits.reshape(b * n, v)
        params = [r.params for r in reqs]
        gens = [r.generator for r in reqs]
        argmax = S.greedy(flat)
        dev = argmax.device
        tok = torch.tensor(nodes, device=dev)
        parent, anc, depth = tree.parent.to(dev), tree.ancestors.to(dev), tree.depth.to(dev)
        probs = sample_u = greedy = None
        if not all(p.is_greedy for p in params):
            st = S.SamplingTensors.from_params(params, flat.device, v).repeat_interleave([n] * b)
            probs, greedy = S.logits_to_probs(flat, st), st.is_greedy
        if probs is not None and self.opts.verify.method == "probabilistic":
            # greedy rows: one-hot at the argmax, their walk then follows the argmax
            target = torch.where(
                greedy[:, None], torch.nn.functional.one_hot(argmax, v).to(probs.dtype), probs
            )
            sampled = ~greedy.view(b, n)[:, 0]
            if prop.draft_probs is None:
                sampled = torch.zeros_like(sampled)
            uniform = draw_uniform((b, n), gens, dev)
            sample_u = S.draw_row_uniforms([1] * b, gens, dev, self.generator)
            deepest, bonus = tree_rejection_sample(
                tok,
                target.view(b, n, v),
                prop.draft_probs,
                sampled,
                tree.children().to(dev),
                tree.max_depth,
                uniform,
                sample_u,
            )
            on_path = anc[torch.arange(b, device=dev), deepest]
        else:
            if probs is not None:
                # a node's pick reads the uniform of its position (depth), as plain decoding there would
                sample_u = position_uniforms_of(reqs, depth).view(-1)
            # [B, 1 + N] the target's own pick at every node
            picks = S.greedy_or_sample(argmax, probs, sample_u, greedy).view(b, n)
            deepest, on_path = tree_accept(tok, picks, parent, anc, depth)
            bonus = picks.gather(1, deepest[:, None]).squeeze(1)
        # the step's host sync
        on_l, bonus_l = on_path.tolist(), bonus.tolist()
        planner = self.planner
        if planner is not None:
            planner.step_cost.observe(b * n, time.perf_counter() - t, drafted=True)
            if prop.confidence is not None and tree.host_parent is not None:
                for i in range(b):
                    planner.observe_tree(tree.host_parent[i], tree.host_depth[i], prop.confidence[i], on_l[i])
            for i, r in enumerate(reqs):
                # the per-position estimates that decide how deep to draft (the ask) learn the accepted depth
                depth_i = tree.max_depth if tree.host_depth is None else max(tree.host_depth[i])
                planner.observe(r.request_id, depth_i, sum(on_l[i]) - 1)
        stats = SpecDecodingStats(max(self.opts.num_speculative_tokens, tree.max_depth))
        emitted, hidden_rows = [], []
        for i, r in enumerate(reqs):
            # breadth-first order = increasing depth
            path = [j for j in range(1, n) if on_l[i][j]]
            emitted.append([nodes[i][j] for j in path] + [bonus_l[i]])
            moved = [(j, d) for d, j in enumerate(path, start=1) if j != d]
            # the accepted nodes' K/V to positions start + 1.. (O(depth) per request)
            if moved:
                self.cache.move(
                    r.slot, [r.num_computed + j for j, _ in moved], [r.num_computed + d for _, d in moved]
                )
            r.num_computed += 1 + len(path)
            r.decode_steps += 1
            r.num_draft_tokens += n - 1
            r.num_accepted_tokens += len(path)
            r.spec_steps.append((tree.max_depth, len(path)))
            stats.observe_draft(n - 1, len(path), tree.max_depth)
            hidden_rows.append([i * n] + [i * n + j for j in path])
        self.counters.spec.add(stats)
        self.spec_log.observe(stats)
        self._commit(reqs, emitted, None)
        self._observe_hidden(reqs, out.hidden if states is None else states, hidden_rows)
        return reqs

    def _align_draft_probs(self, reqs, spec, probs: torch.Tensor, drafts) -> torch.Tensor:
        k = max(len(d) for d in drafts) if drafts else 0
        if len(spec) == len(reqs) and probs.shape[1] == k:
            return probs
        idx = {r.request_id: i for i, r in enumerate(spec)}
        full = torch.zeros(len(reqs), k, probs.shape[-1], device=probs.device, dtype=probs.dtype)
        for b, r in enumerate(reqs):
            if r.request_id in idx and drafts[b]:
                full[b, : len(drafts[b])] = probs[idx[r.request_id], : len(drafts[b])]
        return full

    def _draft_cap(self, r: Request, k: int) -> int:
        """At most k drafts, and room for them and the step's own token within the request's (and the drafter's)
        length."""
        context = min(self.opts.max_model_len, self.opts.draft_max_model_len or 1 << 30)
        return max(0, min(k, length_left(r, context) - 1))

    # ------------------------------------------------------------------ commit
    def _commit(self, reqs: list[Request], tokens: list[list[int]], step) -> None:
        now = time.monotonic()
        for b, (r, toks) in enumerate(zip(reqs, tokens)):
            if r.first_token_time is None:
                r.first_token_time = now
            r.last_token_time = now
            added = commit_tokens(r, toks, self.opts.max_model_len, step, b)
            self.counters.generation_tokens += added
            if r.finish_reason is not None:
                self._finish(r)

    def _finish(self, req: Request, aborted: bool = False) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.cache.free(req.slot)
            req.slot = None
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        if not aborted and may_end_early(req):
            self.early_exposure += len(req.output_token_ids)
            self.early_ends += req.finish_reason == "stop"
        if self.proposer is not None:
            self.proposer.remove_request(req, aborted)
        if self.planner is not None:
            self.planner.remove(req.request_id)
        if aborted:
            self.counters.requests_aborted += 1
        else:
            self.counters.requests_finished += 1

    def release(self, request_id: str) -> None:
        """Forget a finished request (its output has been delivered)."""
        req = self.requests.get(request_id)
        if req is not None and req.finished:
            del self.requests[request_id]

    def output_of(self, r: Request) -> RequestOutput:
        comp = CompletionOutput(
            0,
            r.text,
            list(r.output_token_ids),
            r.cumulative_logprob if r.logprobs is not None else None,
            r.logprobs,
            r.finish_reason,
            r.stop_reason,
        )
        return RequestOutput(
            r.request_id,
            r.prompt,
            r.prompt_token_ids,
            [comp],
            r.finished,
            r.num_draft_tokens,
            r.num_accepted_tokens,
            prompt_logprobs=r.prompt_logprobs,
            kv_transfer_params=r.kv_transfer_params,
            spec_decode_metrics=self._spec_metrics(r) if r.finished and self.proposer is not None else None,
        )

    def _spec_metrics(self, r: Request) -> SpecDecodeMetrics:
        return SpecDecodeMetrics.from_steps(
            r.spec_steps, self.opts.num_speculative_tokens, r.num_draft_tokens
        )
