"""The step loop: admit waiting requests, then one chunked prefill or one decode step (draft, forward, verify,
commit), then stop rules."""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from verispec.engine.drafting import Drafter
from verispec.engine.options import EngineOptions
from verispec.engine.scheduler import Scheduler
from verispec.engine.stop import commit_tokens, length_left, logprob_entry, may_end_early
from verispec.engine.threads import ThreadGovernor
from verispec.metrics import EngineCounters, SpecDecodingLogging, SpecDecodingStats
from verispec.outputs import CompletionOutput, RequestOutput, SpecDecodeMetrics
from verispec.planner.fixed import FixedPlanner
from verispec.planner.goodput import DraftPlanner, chance_to_run
from verispec.proposers.base import Proposer, ProposerNeeds
from verispec.request import Request, Status
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner, RowInput
from verispec.runner.state_pool import StatePool
from verispec.sample import logits as S
from verispec.sample.constraints import set_token_constraints
from verispec.sample.grammar import GrammarState, LazyGrammars
from verispec.sample.logits import make_generator, sample_key
from verispec.sample.metadata import SpecDecodeMetadata, StepTokens, VerifyRule
from verispec.sample.step import sample_step
from verispec.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


def check_request(
    prompt_token_ids: list[int], params, max_model_len: int, vocab: int, has_tokenizer: bool
) -> None:
    """ValueError (HTTP 400) for a request no engine of this model can run."""
    if not prompt_token_ids:
        raise ValueError("prompt must contain at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum model length "
            f"of {max_model_len}. Make sure that `max_model_len` is no smaller than the number of "
            "text tokens."
        )
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    params.check_vocab(vocab)
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True was given)")
    if params.bad_words and not has_tokenizer:
        raise ValueError("bad_words need a tokenizer (skip_tokenizer_init=True was given)")


@dataclass(frozen=True)
class SchedulerStats:
    """Request and KV-slot counts at one moment (the server's /health and gauges read these)."""

    running: int
    waiting: int
    free_kv_slots: int
    num_kv_slots: int
    # the share of KV blocks in use
    kv_cache_usage: float = 0.0


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        opts: EngineOptions,
        proposer: Proposer | None,
        eos_token_ids: tuple[int, ...],
        seed: int = 0,
        planner: DraftPlanner | FixedPlanner | None = None,
    ):
        """planner: chooses each step's draft lengths (None: fixed K, fit to spec_token_budget)."""
        self.runner, self.tokenizer, self.opts, self.proposer = runner, tokenizer, opts, proposer
        self.planner = (
            planner if planner is not None and proposer is not None else FixedPlanner(opts.spec_token_budget)
        )
        self.drafter = Drafter(proposer, self.planner, opts)
        # a proposer that drafts from the target's states gets them after every forward
        self.wants_hidden = proposer is not None and proposer.needs.target_hidden != "none"
        self.cache: KVCache = runner.cache
        self.eos_token_ids = eos_token_ids
        self.device = runner.device
        self.generator = make_generator(seed, self.device)
        # requests join only between runs (LLM.generate sets it): once none wait, the running batch is all the work
        # left, and the planner weighs a token by the time it saves that batch (DraftPlanner.token_worth)
        self.closed = False
        # requests that could end before their length (EOS, stop rules) and finished: how many did, and the tokens
        # they committed (the early-end rate a closed batch's plan reads: chance_to_run)
        self.early_ends = 0
        self.early_exposure = 0
        self.requests: dict[str, Request] = {}
        # the last step was a prefill chunk (the next one decodes, if requests are decoding)
        self._prefilled = False
        k = opts.num_speculative_tokens if proposer is not None else 0
        self.counters = EngineCounters(num_spec_tokens=k, spec=SpecDecodingStats(k) if proposer else None)
        self.scheduler = Scheduler(self.cache, self.counters, opts.enable_prefix_caching)
        # a decode step writes its newest token and drafts: up to this many positions past the last
        self.scheduler.lookahead = max(0, self.cache.t_alloc - 1 - opts.max_model_len)
        # a drafter of every position's states (or extract_hidden_states, which saves them) gets a cached prefix's
        # states from the pool beside the KV blocks
        needs = proposer.needs if proposer is not None else ProposerNeeds()
        every = (needs.target_hidden == "all" or needs.observes_states) and opts.enable_prefix_caching
        self.state_pool = StatePool(self.cache) if every else None
        self.can_hit = needs.target_hidden != "all" and not needs.observes_states or every
        self.spec_log = SpecDecodingLogging(k, opts.log_interval_s) if proposer else None
        # one thread while another busy process shares the cores (engine/threads.py); one process on the CPU only
        local = self.device.type == "cpu" and getattr(runner, "close", None) is None
        adaptive = os.environ.get("VERISPEC_ADAPTIVE_THREADS", "1") != "0"
        gov = ThreadGovernor(torch.get_num_threads())
        self.thread_governor = gov if local and adaptive and gov.active else None
        # structured outputs: built on the first request that asks (the tokenizer's vocabulary is read once)
        self._grammars = LazyGrammars(tokenizer, self.runner.model.cfg.vocab_size, self.eos_token_ids)
        if self.spec_log is not None:
            self.spec_log.extra = self._log_line

    def _log_line(self) -> str:
        """The periodic log line's tail: the planner's figures, the prefix cache's hit rate and the KV usage."""
        c = self.counters
        hits = c.prefix_cache_hits / c.prefix_cache_queries if c.prefix_cache_queries else 0.0
        return f"{self.planner.log_line()}, Prefix cache hit rate: {hits:.1%}, KV cache usage: {self.cache.usage:.1%}"

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache); False while requests hold blocks."""
        return self.cache.pool.reset()

    # ------------------------------------------------------------------ requests
    def grammar_for(self, params) -> GrammarState | None:
        """The matcher of params.structured_outputs (None without one), compiled or from the cache; ValueError
        naming the field for a bad constraint. Safe to call from any thread (the server compiles off the engine's)."""
        return self._grammars.matcher_for(params)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params,
        bad_words_token_ids: list[list[int]] | None = None,
        cache_salt: str | None = None,
        grammar: GrammarState | None = None,
    ) -> Request:
        """Validate and queue a request. bad_words_token_ids, grammar: params.bad_words already tokenized and
        params.structured_outputs already compiled by the caller (the server does both off the thread that steps
        the engine; `grammar_for`)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        vocab = self.runner.model.cfg.vocab_size
        check_request(prompt_token_ids, params, self.opts.max_model_len, vocab, self.tokenizer is not None)
        req = Request(request_id, prompt, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids)
        set_token_constraints(req, self.tokenizer, vocab, self.device, bad_words_token_ids)
        req.grammar = grammar if grammar is not None else self.grammar_for(params)
        req.cache_salt = cache_salt
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
        return SchedulerStats(
            len(self.running), len(self.waiting), self.cache.num_free, self.cache.num_slots, self.cache.usage
        )

    def running_request_ids(self) -> list[str]:
        """The requests the next step runs (the ones a failed step is blamed on)."""
        return [r.request_id for r in self.running]

    # ------------------------------------------------------------------ step
    def close(self) -> None:
        """Stop what the engine started (tensor parallelism's other ranks); idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def step(self) -> list[RequestOutput]:
        self._admit()
        if not self.running:
            return []
        gov = self.thread_governor
        if gov is None:
            return self._step()
        gov.start()
        try:
            return self._step()
        finally:
            gov.stop()

    def _step(self) -> list[RequestOutput]:
        prefill = [r for r in self.running if r.in_prefill]
        c, t0, n0 = self.counters, time.perf_counter(), self.counters.generation_tokens
        # chunked prefill interleaved with decoding: while prompts are prefilled in chunks, every chunk is followed
        # by a decode step of the running requests, so their streams stall one chunk at most
        decoding = len(prefill) < len(self.running)
        if prefill and not (decoding and self._prefilled):
            touched = self._prefill(prefill)
            c.prefill_seconds += time.perf_counter() - t0
            self._prefilled = True
        else:
            self._preempt(self.scheduler.make_room())
            live = [r for r in self.running if not r.in_prefill]
            touched = self._decode(live) if live else []
            c.decode_seconds += time.perf_counter() - t0
            c.decode_tokens += c.generation_tokens - n0
            self._prefilled = False
        c.kv_cache_usage = self.cache.usage
        if self.spec_log is not None:
            self.spec_log.maybe_log()
        return [self.output_of(r) for r in touched]

    def _admit(self) -> None:
        for req in self.scheduler.admit(self.can_hit):
            if self.proposer is not None:
                self.proposer.add_request(req)
            # a cached prefix: the drafter reads its positions' states as if the target had just computed them
            states = (
                self.state_pool.read(req.slot, req.num_computed)
                if self.state_pool and req.num_computed
                else None
            )
            if states is None:
                continue
            if self.proposer.needs.observes_states:
                # [n, len(aux_layers), H]: as if the target had just fed the prefix's tokens
                n, layers = req.num_computed, len(self.proposer.needs.aux_layers)
                self.proposer.observe_states([req], [req.tokens_from(0)[:n]], [states.view(n, layers, -1)])
            else:
                self.proposer.observe_hidden([req], [states])

    def _preempt(self, reqs: list[Request]) -> None:
        """Preempted requests start over in the proposer when readmitted (their tokens are recomputed)."""
        if self.proposer is not None:
            for req in reqs:
                self.proposer.remove_request(req, False)

    def _prefill(self, reqs: list[Request]) -> list[Request]:
        """Chunked prefill of waiting prompts; one padded forward over the chosen requests."""
        reqs = sorted(reqs, key=lambda r: r.slot)
        budget = self.opts.max_num_batched_tokens
        rows, chosen = [], []
        for r in reqs:
            n = min(r.prefill_end - r.num_computed, budget)
            if n <= 0 or (rows and self._padding_waste(rows, r, n)):
                break
            final = r.num_computed + n == r.prefill_end
            # logits for every position of the chunk (a preempted request has its prompt logprobs already)
            every = r.params.prompt_logprobs is not None and not r.resuming
            rows.append(
                RowInput(
                    r.slot,
                    r.num_computed,
                    r.tokens_from(r.num_computed)[:n],
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
            if r.params.prompt_logprobs is not None and not r.resuming:
                self._add_prompt_logprobs(r, out.logits[at : at + n_rows])
            r.num_computed += len(row.token_ids)
            if not r.in_prefill:
                finals.append(r)
                last_rows.append(at + n_rows - 1)
            at += n_rows
        # every prompt position of every chunk: its rows of the states
        sizes = [len(row.token_ids) for row in rows]
        chunks = [range(s, s + n) for s, n in zip(accumulate(sizes, initial=0), sizes)]
        self._keep_states(chosen, states, chunks)
        self.scheduler.cache_committed(chosen)
        # a preempted request's recompute ends where it left off: its next token is known
        sampled = [(r, i) for r, i in zip(finals, last_rows) if not r.resuming]
        if sampled:
            done, picked = [r for r, _ in sampled], [i for _, i in sampled]
            logits = out.logits if len(picked) == at else out.logits[picked]
            step = sample_step(done, logits, SpecDecodeMetadata.none(len(done)), VerifyRule())
            self._commit(done, step.tokens, step)
        for r in finals:
            r.recompute_to = 0
        if not self.wants_hidden:
            return finals
        if states is not None:
            self._observe_hidden(chosen, states, chunks)
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
            parts = stacked.split([len(r.token_ids) for r in rows])
            self.proposer.observe_states(reqs, [r.token_ids for r in rows], list(parts))
            if self.state_pool is not None:
                # nothing is speculated: every token fed is committed, its states kept beside its K/V
                for row, part in zip(rows, parts):
                    self.state_pool.write(row.slot, row.start, part.flatten(1))
        if not want_all:
            return out, None
        return out, (out.aux_hidden if aux else out.hidden_all)

    def _keep_states(self, reqs: list[Request], states: torch.Tensor | None, rows) -> None:
        """The committed positions' states (rows of `states`, per request, the last behind its newest committed
        position) into the state pool beside their K/V, before the commit may end a request and free its slot."""
        if self.state_pool is None or states is None:
            return
        for r, idx in zip(reqs, rows):
            self.state_pool.write(r.slot, r.num_computed - len(idx), _rows_of(states, idx))

    def _observe_hidden(
        self, reqs: list[Request], hidden: torch.Tensor, rows: list[range] | list[list[int]]
    ) -> None:
        """Hand a proposer that drafts from the target's state the rows of `hidden` for the positions this forward
        committed, per live request in position order, the last one behind the newest token (target_hidden "all"),
        or that last row alone ("last": Medusa, MLP speculator). A range of rows is handed over as a view (no copy,
        no index tensor); a list (a tree's path) is gathered."""
        p = self.proposer
        live = [
            (r, idx[-1:] if p.needs.target_hidden == "last" else idx)
            for r, idx in zip(reqs, rows)
            if not r.finished
        ]
        if live:
            p.observe_hidden([r for r, _ in live], [_rows_of(hidden, i) for _, i in live])

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
        """Draft, one forward over every request's last token and drafts, verify, commit."""
        drafts = self.drafter.draft(reqs, self._token_worth)
        spec = drafts.spec
        self.counters.grammar_cut_drafts += drafts.grammar_cut
        self.counters.grammar_forced_drafts += drafts.grammar_forced
        rows = _rows(reqs, spec)
        t = time.perf_counter()
        out, states = self._forward(reqs, rows)
        step = sample_step(reqs, out.logits, spec, self.opts.verify, self.generator)
        # step.num_accepted is on the host: the step's work is done
        n_rows = sum(len(row.token_ids) for row in rows)
        ids = [r.request_id for r in reqs]
        learn_spec, learn_step = _proposer_part(spec, step, drafts.proposed)
        self.planner.observe_verified(
            ids,
            learn_spec,
            drafts.confidence,
            learn_step,
            n_rows,
            time.perf_counter() - t,
            drafts.longest_ask,
        )
        self.planner.report(self.counters)
        self._accept(reqs, spec, step)
        hidden_rows = _hidden_rows(spec, step) if self.wants_hidden else None
        self._keep_states(reqs, states, hidden_rows)
        self._commit(reqs, step.tokens, step)
        self.scheduler.cache_committed(reqs)
        if self.wants_hidden:
            self._observe_hidden(reqs, out.hidden if states is None else states, hidden_rows)
        return reqs

    def _accept(self, reqs: list[Request], spec: SpecDecodeMetadata, step: StepTokens) -> None:
        """Move each request past its accepted drafts (the rejected ones roll back: O(1)), a tree's accepted nodes'
        K/V to the positions after the root, and count the step's drafts (a step without any adds nothing)."""
        tree = spec.tree
        k = (
            self.opts.num_speculative_tokens
            if tree is None
            else max(self.opts.num_speculative_tokens, tree.max_depth)
        )
        stats = None
        for b, (r, d, n) in enumerate(zip(reqs, spec.draft_token_ids, step.num_accepted)):
            if tree is not None:
                self._compact_path(r, step.accepted_nodes(b))
            r.num_computed += 1 + n
            r.decode_steps += 1
            if d:
                # a chain covers its own length of positions, a tree its depth
                depth = len(d) if tree is None else tree.max_depth
                r.num_draft_tokens += len(d)
                r.num_accepted_tokens += n
                if self.opts.spec_metrics != "none":
                    r.spec_steps.append((depth, len(d), n))
                stats = stats or SpecDecodingStats(k)
                stats.observe_draft(len(d), n, depth)
        if stats is not None:
            self.counters.spec.add(stats)
            self.spec_log.observe(stats)

    def _compact_path(self, r: Request, path: list[int]) -> None:
        """A tree's accepted nodes (breadth-first = increasing depth) to positions start + 1.. (O(depth))."""
        moved = [(j, d) for d, j in enumerate(path, start=1) if j != d]
        if moved:
            self.cache.move(
                r.slot, [r.num_computed + j for j, _ in moved], [r.num_computed + d for _, d in moved]
            )

    def _token_worth(self, reqs: list[Request], spec: list[Request]) -> list[float] | None:
        """Per speculating request, what its tokens are worth to a closed batch (DraftPlanner.token_worth). Each
        request ends at its length limit after as many steps as its tokens left take at its commit rate so far
        (a request whose drafts keep being accepted is not the one the batch waits for, though it has as many
        tokens left); weighed by the chance that every request that may end earlier (EOS, stop rules) runs that
        long, from the early ends seen so far (chance_to_run). None where finished requests' slots may be
        refilled."""
        # a batch of one: each of its tokens is worth a whole step, as in an open batch
        if not self.planner.weighs_worth or not self.closed or self.waiting or len(reqs) == 1:
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

    # ------------------------------------------------------------------ commit
    def _commit(self, reqs: list[Request], tokens: list[list[int]], step) -> None:
        now = time.monotonic()
        for b, (r, toks) in enumerate(zip(reqs, tokens)):
            if r.first_token_time is None:
                r.first_token_time = now
            r.last_token_time = now
            added = commit_tokens(r, toks, self.opts.max_model_len, step, b)
            self.counters.generation_tokens += added
            if r.grammar is not None and r.finish_reason is None:
                new = r.output_token_ids[len(r.output_token_ids) - added :]
                if not r.grammar.accept(new):
                    logger.error(
                        "request %s: its grammar refused tokens %s (%s)", r.request_id, new, r.grammar.error
                    )
                    r.finish_reason = "abort"
            if r.finish_reason is not None:
                self._finish(r)

    def _finish(self, req: Request, aborted: bool = False) -> None:
        # its last full blocks too: a chat's next turn starts with this one's answer
        self.scheduler.cache_committed([req])
        self.scheduler.finish(req)
        req.status = Status.FINISHED
        if not aborted and may_end_early(req):
            self.early_exposure += len(req.output_token_ids)
            self.early_ends += req.finish_reason == "stop"
        if self.proposer is not None:
            self.proposer.remove_request(req, aborted)
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
        # on the finished output only, as vLLM
        spec = self._spec_metrics(r) if r.finished else None
        comp = CompletionOutput(
            0,
            r.text,
            list(r.output_token_ids),
            r.cumulative_logprob if r.logprobs is not None else None,
            r.logprobs,
            r.finish_reason,
            r.stop_reason,
            spec,
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
            spec_decode_metrics=spec,
        )

    def _spec_metrics(self, r: Request) -> SpecDecodeMetrics | None:
        """The request's SpecDecodeMetrics, or None when not asked for or without a speculative method."""
        level = self.opts.spec_metrics
        if level == "none" or self.proposer is None:
            return None
        return SpecDecodeMetrics.from_steps(
            r.spec_steps, self.opts.num_speculative_tokens, level == "detailed"
        )


def _rows(reqs: list[Request], spec: SpecDecodeMetadata) -> list[RowInput]:
    """A decode step's rows: each request's newest token, then its chain of drafts or its tree's nodes."""
    tree = spec.tree
    if tree is None:
        return [
            RowInput(r.slot, r.num_computed, [r.last_token_id] + d)
            for r, d in zip(reqs, spec.draft_token_ids)
        ]
    depths = tree.depth.tolist()
    return [
        RowInput(r.slot, r.num_computed, [r.last_token_id] + t, tree_mask=tree.ancestors[b], depths=depths[b])
        for b, (r, t) in enumerate(zip(reqs, spec.draft_token_ids))
    ]


def _proposer_part(
    spec: SpecDecodeMetadata, step: StepTokens, proposed: list[int] | None
) -> tuple[SpecDecodeMetadata, StepTokens]:
    """The step as the planner learns from it: the proposer's drafts and how many of those were accepted, without
    the drafts a grammar forced after them (the rows they took still count in the step's cost)."""
    if proposed is None:
        return spec, step
    drafts = [d[:p] for d, p in zip(spec.draft_token_ids, proposed)]
    accepted = [min(n, p) for n, p in zip(step.num_accepted, proposed)]
    return SpecDecodeMetadata(drafts, spec.draft_probs), replace(step, num_accepted=accepted)


def _rows_of(hidden: torch.Tensor, idx: range | list[int]) -> torch.Tensor:
    """The rows idx of hidden: a range as a view (over every row: the tensor itself, since even a view costs tens of
    microseconds right after a forward, whose weights have streamed through the caches), a list gathered."""
    if isinstance(idx, range):
        return hidden if idx.start == 0 and idx.stop == hidden.shape[0] else hidden[idx.start : idx.stop]
    return hidden[torch.tensor(idx, device=hidden.device)]


def _hidden_rows(spec: SpecDecodeMetadata, step: StepTokens) -> list[range] | list[list[int]]:
    """Per request, the rows of the step's states behind the positions it committed: the newest token and the
    accepted drafts (a range for a chain, a list of rows for a tree's path)."""
    if spec.tree is None:
        starts = accumulate((1 + len(d) for d in spec.draft_token_ids), initial=0)
        return [range(s, s + 1 + n) for s, n in zip(starts, step.num_accepted)]
    n = step.row_stride
    return [[b * n] + [b * n + j for j in step.accepted_nodes(b)] for b in range(len(step.tokens))]
