import pytest

from verispec.metrics import Counter, EngineCounters, Gauge, Histogram, Metric, SpecDecodingStats, Vector


def test_to_metrics_uses_vllm_reader_types():
    spec = SpecDecodingStats(3)
    spec.observe_draft(3, 2)
    spec.observe_draft(2, 0)
    c = EngineCounters(num_spec_tokens=3, prompt_tokens=7, generation_tokens=5, spec=spec)
    metrics = c.to_metrics(num_running=2, num_waiting=1)
    assert all(isinstance(m, Metric) and isinstance(m.labels, dict) for m in metrics)
    by_name = {m.name: m for m in metrics}
    assert len(by_name) == len(metrics), "one entry per metric name"
    assert by_name["vllm:prompt_tokens"] == Counter("vllm:prompt_tokens", {}, 7)
    assert by_name["vllm:num_requests_running"] == Gauge("vllm:num_requests_running", {}, 2.0)
    assert isinstance(by_name["vllm:num_requests_waiting"], Gauge)
    assert by_name["vllm:spec_decode_num_drafts"] == Counter("vllm:spec_decode_num_drafts", {}, 2)
    assert by_name["vllm:spec_decode_num_draft_tokens"].value == 5
    assert by_name["vllm:spec_decode_num_accepted_tokens"].value == 2
    per_pos = by_name["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == [1, 1, 0]
    # a snapshot: later steps do not change metrics already returned
    spec.observe_draft(3, 3)
    assert per_pos.values == [1, 1, 0]


def test_no_spec_metrics_without_speculation():
    names = {m.name for m in EngineCounters().to_metrics(0, 0)}
    assert "vllm:generation_tokens" in names and not any(n.startswith("vllm:spec_decode") for n in names)


def test_histogram_fields():
    h = Histogram("vllm:e2e_request_latency_seconds", {}, count=3, sum=1.5, buckets={"1.0": 2, "+Inf": 3})
    assert h.count == h.buckets["+Inf"] and h.sum == 1.5


def test_per_position_draft_counts():
    s = SpecDecodingStats(4)
    s.observe_draft(4, 2)
    s.observe_draft(2, 2)
    s.observe_draft(1, 0)
    # no draft: not counted
    s.observe_draft(0, 0)
    assert s.num_drafts == 3 and s.num_draft_tokens == 7 and s.num_accepted_tokens == 4
    assert s.num_draft_tokens_per_pos == [3, 2, 1, 1]
    assert s.num_accepted_tokens_per_pos == [2, 2, 0, 0]
    total = SpecDecodingStats(4)
    total.add(s)
    total.add(s)
    assert total.num_draft_tokens_per_pos == [6, 4, 2, 2] and total.num_accepted_tokens_per_pos == [
        4,
        4,
        0,
        0,
    ]


def test_tree_draft_counts_positions_by_depth():
    s = SpecDecodingStats(5)
    # 5 tree nodes, depth 3, a path of 2 accepted
    s.observe_draft(5, 2, num_draft_positions=3)
    assert s.num_draft_tokens == 5 and s.num_draft_tokens_per_pos == [1, 1, 1, 0, 0]
    assert s.num_accepted_tokens_per_pos == [1, 1, 0, 0, 0]


@pytest.mark.parametrize(
    "drafted,accepted,positions,match",
    [
        (2, 3, None, "accepted 3 tokens of a draft of 2 tokens"),
        (0, 1, None, "accepted 1 tokens of a draft of 0 tokens"),
        (2, -1, None, "accepted -1 tokens"),
        (5, 4, 3, "over 3 positions"),
        (5, 1, None, "exceeds num_spec_tokens=4"),
    ],
)
def test_impossible_observations_are_errors(drafted, accepted, positions, match):
    s = SpecDecodingStats(4)
    with pytest.raises(ValueError, match=match):
        s.observe_draft(drafted, accepted, positions)
    assert s.num_drafts == 0 and s.num_accepted_tokens_per_pos == [0] * 4


def test_planner_gauges_only_when_it_plans():
    spec = SpecDecodingStats(3)
    names = {m.name for m in EngineCounters(num_spec_tokens=3, spec=spec).to_metrics(0, 0)}
    assert not any(
        n.startswith("verispec:spec_decode_mean") or n.startswith("verispec:spec_decode_verified")
        for n in names
    )
    c = EngineCounters(num_spec_tokens=3, spec=spec, mean_chosen_k=1.5, verified_row_cost=0.2)
    by_name = {m.name: m for m in c.to_metrics(0, 0)}
    assert by_name["verispec:spec_decode_mean_chosen_k"] == Gauge(
        "verispec:spec_decode_mean_chosen_k", {}, 1.5
    )
    assert by_name["verispec:spec_decode_verified_row_cost"].value == 0.2


def test_server_exports_the_planner_gauges():
    from prometheus_client import generate_latest

    from verispec.server.metrics import ServerMetrics

    m = ServerMetrics("tiny", num_spec_tokens=3, num_kv_slots=4)
    c = EngineCounters(num_spec_tokens=3, spec=SpecDecodingStats(3))
    m.sync_counters(c)
    text = generate_latest(m.registry).decode()
    # nothing planned yet: no planner series
    assert 'verispec:spec_decode_mean_chosen_k{model_name="tiny"}' not in text
    c.mean_chosen_k, c.verified_row_cost = 2.25, 0.125
    m.sync_counters(c)
    text = generate_latest(m.registry).decode()
    assert 'verispec:spec_decode_mean_chosen_k{model_name="tiny"} 2.25' in text
    assert 'verispec:spec_decode_verified_row_cost{model_name="tiny"} 0.125' in text
