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
