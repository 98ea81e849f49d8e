"""The app's routes (verispec/server/app.py): /v1/models, /health, /version and /metrics (vLLM's metric names),
and the flags that set what they report."""

from __future__ import annotations

import httpx


def test_models_health_version_and_config_precedence(plain, spec):
    assert [m.id for m in plain.client().models.list().data] == ["tiny"]
    assert [m.id for m in spec.client().models.list().data] == ["tiny", "tiny-alias"]
    health = httpx.get(f"{plain.url}/health").json()
    # --max-num-seqs beats the file's 4
    assert health["status"] == "ok" and health["num_kv_slots"] == 8
    assert httpx.get(f"{spec.url}/health").json()["num_kv_slots"] == 2
    assert httpx.get(f"{plain.url}/version").json()["version"]
    text = httpx.get(f"{spec.url}/metrics").text
    for name in (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert name in text, name
    assert 'position="2"' in text and 'model_name="tiny"' in text
