"""Prometheus metrics with vLLM's names, on a private registry. Updated only from the engine thread.

Counters mirror `EngineCounters` (synced by delta after every engine step / command), so the reference's PromQL
works unchanged, e.g. acceptance rate = rate(vllm:spec_decode_num_accepted_tokens_total) /
rate(vllm:spec_decode_num_draft_tokens_total).
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from verispec.metrics import EngineCounters

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# vLLM's FinishReason values: every one exported from the start
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    def __init__(self, model_name: str, num_spec_tokens: int, num_kv_slots: int):
        # as vLLM: no *_created series
        prometheus_client.disable_created_metrics()
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.model_name, self.num_kv_slots = model_name, num_kv_slots
        m = ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", m, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            m + ["finished_reason"],
            registry=r,
        )
        self.request_aborted = Counter(
            "vllm:request_aborted", "Count of aborted requests (client disconnects).", m, registry=r
        )
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", m, registry=r
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", m, registry=r
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m, registry=r
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            m,
            registry=r,
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", m, registry=r
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", m, registry=r
        )
        self.kv_free = Gauge("verispec:kv_cache_free_slots", "Free KV-cache sequence slots.", m, registry=r)
        self._add_histograms()
        self.k = num_spec_tokens
        if num_spec_tokens:
            self._add_spec_counters()
        self._last: dict[str, int] = {}
        self._init_children()

    def _add_histograms(self) -> None:
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            m,
            buckets=E2E_BUCKETS,
            registry=r,
        )

    def _add_spec_counters(self) -> None:
        """vLLM's speculative-decoding counters (only when the server speculates)."""
        r, m = self.registry, ["model_name"]
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", m, registry=r)
        self.draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", m, registry=r
        )
        self.accepted = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", m, registry=r
        )
        self.per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            m + ["position"],
            registry=r,
        )
        # structured outputs: drafts the grammar refused (never verified) and drafts it forced
        self.grammar_cut = Counter(
            "verispec:spec_decode_num_grammar_cut_draft_tokens",
            "Draft tokens cut before verification because the request's grammar refused them.",
            m,
            registry=r,
        )
        self.grammar_forced = Counter(
            "verispec:spec_decode_num_grammar_forced_draft_tokens",
            "Draft tokens the request's grammar forced (verified like any other draft).",
            m,
            registry=r,
        )
        # the goodput planner's (exported once it has planned a step)
        self.mean_chosen_k = Gauge(
            "verispec:spec_decode_mean_chosen_k",
            "Mean draft length the planner verified per request.",
            m,
            registry=r,
        )
        self.verified_row_cost = Gauge(
            "verispec:spec_decode_verified_row_cost",
            "Measured cost of one more verified row relative to a plain decode step.",
            m,
            registry=r,
        )

    def _init_children(self) -> None:
        """Create every labelled child up front so each series is exported (at 0) from the start."""
        name = self.model_name
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.request_aborted,
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.ttft,
            self.itl,
            self.e2e,
        ):
            metric.labels(name)
        for reason in FINISH_REASONS:
            self.request_success.labels(name, reason)
        if self.k:
            for metric in (
                self.drafts,
                self.draft_tokens,
                self.accepted,
                self.grammar_cut,
                self.grammar_forced,
            ):
                metric.labels(name)
            for i in range(self.k):
                self.per_pos.labels(name, str(i))
        self.update_gauges(0, 0, self.num_kv_slots, 0.0)

    # ------------------------------------------------------------------ engine-thread updates
    def _inc(self, counter, key: str, value: int, *labels: str) -> None:
        delta = value - self._last.get(key, 0)
        if delta:
            counter.labels(self.model_name, *labels).inc(delta)
            self._last[key] = value

    def sync_counters(self, c: EngineCounters) -> None:
        """Bring the Prometheus counters up to the engine's cumulative counters."""
        self._inc(self.prompt_tokens, "prompt", c.prompt_tokens)
        self._inc(self.generation_tokens, "generation", c.generation_tokens)
        self._inc(self.request_aborted, "aborted", c.requests_aborted)
        self._inc(self.prefix_queries, "prefix_queries", c.prefix_cache_queries)
        self._inc(self.prefix_hits, "prefix_hits", c.prefix_cache_hits)
        self._inc(self.preemptions, "preemptions", c.num_preemptions)
        if self.k and c.spec is not None:
            s = c.spec
            self._inc(self.drafts, "drafts", s.num_drafts)
            self._inc(self.draft_tokens, "draft_tokens", s.num_draft_tokens)
            self._inc(self.accepted, "accepted", s.num_accepted_tokens)
            self._inc(self.grammar_cut, "grammar_cut", c.grammar_cut_drafts)
            self._inc(self.grammar_forced, "grammar_forced", c.grammar_forced_drafts)
            for i, n in enumerate(s.num_accepted_tokens_per_pos[: self.k]):
                self._inc(self.per_pos, f"pos{i}", n, str(i))
            if c.mean_chosen_k is not None:
                self.mean_chosen_k.labels(self.model_name).set(c.mean_chosen_k)
                self.verified_row_cost.labels(self.model_name).set(c.verified_row_cost or 0.0)

    def update_gauges(self, running: int, waiting: int, free_slots: int, kv_usage: float) -> None:
        """kv_usage: the share of KV blocks in use."""
        name = self.model_name
        self.running.labels(name).set(running)
        self.waiting.labels(name).set(waiting)
        self.kv_free.labels(name).set(free_slots)
        self.kv_usage.labels(name).set(kv_usage)

    def request_finished(self, finish_reason: str | None) -> None:
        if finish_reason in FINISH_REASONS:
            self.request_success.labels(self.model_name, finish_reason).inc()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.labels(self.model_name).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
