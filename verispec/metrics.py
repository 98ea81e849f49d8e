"""Speculative-decoding statistics (pure), vLLM's periodic log line, and get_metrics()'s metric objects
(vllm.v1.metrics.reader's types: Counter, Gauge, Vector, Histogram)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("verispec")


@dataclass
class SpecDecodingStats:
    """Counts for one engine step (or an aggregate of steps). Position i counts the drafts that reached draft
    position i (``num_draft_tokens_per_pos``) and those whose token there was accepted
    (``num_accepted_tokens_per_pos``), as current vLLM keeps them."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        if not self.num_draft_tokens_per_pos:
            self.num_draft_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(
        self, num_draft_tokens: int, num_accepted_tokens: int, num_draft_positions: int | None = None
    ) -> None:
        """One request's verified draft. ``num_draft_positions`` is how many positions it covers (a chain:
        ``num_draft_tokens``; a tree: its depth). Accepting more tokens than were drafted, or than there are
        positions, is an error in the caller, not something to clamp."""
        positions = num_draft_tokens if num_draft_positions is None else num_draft_positions
        if not 0 <= num_accepted_tokens <= min(num_draft_tokens, positions):
            raise ValueError(
                f"accepted {num_accepted_tokens} tokens of a draft of {num_draft_tokens} tokens "
                f"over {positions} positions"
            )
        if positions > self.num_spec_tokens:
            raise ValueError(
                f"a draft over {positions} positions exceeds num_spec_tokens={self.num_spec_tokens}"
            )
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(positions):
            self.num_draft_tokens_per_pos[i] += 1
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[i] += n
        for i, n in enumerate(other.num_draft_tokens_per_pos):
            self.num_draft_tokens_per_pos[i] += n

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (the bonus/recovered token counts), as vLLM reports it."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def per_position_rates(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.num_accepted_tokens_per_pos]


def format_spec_log(s: SpecDecodingStats, elapsed_s: float) -> str:
    """vLLM's SpecDecodingLogging line."""
    rates = ", ".join(f"{r:.3f}" for r in s.per_position_rates())
    dt = max(elapsed_s, 1e-9)
    return (
        f"SpecDecoding metrics: Mean acceptance length: {s.mean_acceptance_length:.2f}, "
        f"Accepted throughput: {s.num_accepted_tokens / dt:.2f} tokens/s, "
        f"Drafted throughput: {s.num_draft_tokens / dt:.2f} tokens/s, "
        f"Accepted: {s.num_accepted_tokens} tokens, Drafted: {s.num_draft_tokens} tokens, "
        f"Per-position acceptance rate: {rates}, "
        f"Avg Draft acceptance rate: {100 * s.acceptance_rate:.1f}%"
    )


class SpecDecodingLogging:
    """Accumulates step stats and logs one line every `interval_s` seconds."""

    def __init__(self, num_spec_tokens: int, interval_s: float = 10.0):
        self.k, self.interval = num_spec_tokens, interval_s
        # more text for the line (the planner's figures), or None
        self.extra = None
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.window = SpecDecodingStats(self.k)
        self.since = now

    def observe(self, step: SpecDecodingStats) -> None:
        self.window.add(step)

    def maybe_log(self, force: bool = False) -> str | None:
        now = time.monotonic()
        if not force and now - self.since < self.interval:
            return None
        if self.window.num_drafts == 0:
            self._reset(now)
            return None
        line = format_spec_log(self.window, now - self.since) + (self.extra() if self.extra else "")
        logger.info(line)
        self._reset(now)
        return line


@dataclass
class Metric:
    """One exported metric, as vllm.v1.metrics.reader: a name and key=value labels. The subclasses carry values."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters, indexed by position: vLLM models
    vllm:spec_decode_num_accepted_tokens_per_pos with it (one entry, not one per position)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A numerical value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets keyed by their upper limit (a '+Inf' key always exists); count and sum over all."""

    count: int
    sum: float
    buckets: dict[str, int]


@dataclass
class EngineCounters:
    """Cumulative counters since engine start (exported by get_metrics() and /metrics)."""

    num_spec_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    spec: SpecDecodingStats | None = None
    # wall time in prefill steps / decode (incl. speculative) steps, and the tokens the decode steps produced:
    # decode throughput apart from prompt processing (benchmarks; not exported)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    # the goodput planner's mean chosen draft length and the measured cost of a verified row relative to a plain
    # step (None when it is off)
    mean_chosen_k: float | None = None
    verified_row_cost: float | None = None
    # prefix-cache lookups and hits in tokens, recompute preemptions, the share of KV blocks in use
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    kv_cache_usage: float = 0.0
    # structured outputs: drafts cut because the grammar refused them (never verified, so not in
    # spec_decode_num_draft_tokens, as vLLM), and drafts the grammar forced (verified and counted like any other)
    grammar_cut_drafts: int = 0
    grammar_forced_drafts: int = 0

    def to_metrics(self, num_running: int, num_waiting: int) -> list[Metric]:
        out: list[Metric] = [
            Counter("vllm:prompt_tokens", {}, self.prompt_tokens),
            Counter("vllm:generation_tokens", {}, self.generation_tokens),
            Counter("vllm:request_success", {}, self.requests_finished),
            Counter("vllm:request_aborted", {}, self.requests_aborted),
            Gauge("vllm:num_requests_running", {}, float(num_running)),
            Gauge("vllm:num_requests_waiting", {}, float(num_waiting)),
            Gauge("vllm:kv_cache_usage_perc", {}, self.kv_cache_usage),
            Counter("vllm:prefix_cache_queries", {}, self.prefix_cache_queries),
            Counter("vllm:prefix_cache_hits", {}, self.prefix_cache_hits),
            Counter("vllm:num_preemptions", {}, self.num_preemptions),
        ]
        if self.spec is not None:
            s = self.spec
            out += [
                Counter("vllm:spec_decode_num_drafts", {}, s.num_drafts),
                Counter("vllm:spec_decode_num_draft_tokens", {}, s.num_draft_tokens),
                Counter("vllm:spec_decode_num_accepted_tokens", {}, s.num_accepted_tokens),
                Counter("verispec:spec_decode_num_grammar_cut_draft_tokens", {}, self.grammar_cut_drafts),
                Counter(
                    "verispec:spec_decode_num_grammar_forced_draft_tokens", {}, self.grammar_forced_drafts
                ),
                Vector(
                    "vllm:spec_decode_num_accepted_tokens_per_pos", {}, list(s.num_accepted_tokens_per_pos)
                ),
            ]
        if self.mean_chosen_k is not None:
            out += [
                Gauge("verispec:spec_decode_mean_chosen_k", {}, self.mean_chosen_k),
                Gauge("verispec:spec_decode_verified_row_cost", {}, self.verified_row_cost or 0.0),
            ]
        return out
