"""What both endpoints share (verispec/server/serving.py): prompts x n fanned out in order, the per-request
speculative-decoding metrics, kv_transfer_params of extract_hidden_states."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import API_KEY, PROMPTS, Server, greedy
from verispec import SamplingParams


def test_prompt_batches_and_content_parts(plain, llm):
    client = plain.client()
    refs = llm.generate(
        PROMPTS[:2],
        SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    r = client.completions.create(
        model="tiny",
        prompt=PROMPTS[:2],
        n=2,
        temperature=0.8,
        seed=3,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    # prompt-major, as OpenAI / vLLM order them
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [o.text for ref in refs for o in ref.outputs]
    assert r.usage.prompt_tokens == sum(len(ref.prompt_token_ids) for ref in refs)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    ref = llm.chat([{"role": "user", "content": "hello"}], greedy(5), use_tqdm=False)[0].outputs[0].text
    c = client.chat.completions.create(
        model="tiny", messages=parts, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.choices[0].message.content == ref


def check_spec_metrics(m: dict, completion_tokens: int) -> None:
    """The figures of one response's speculation (vLLM's fields at `detailed`, and verispec's per-position ones)
    agree with each other and with its tokens."""
    assert m["num_spec_tokens"] == 3 and len(m["acceptance_histogram"]) == 4
    assert m["num_spec_steps"] == sum(m["acceptance_histogram"]) == len(m["per_step_accepted"])
    assert len(m["per_step_drafted"]) == m["num_spec_steps"]
    assert (
        m["num_accepted_draft_tokens"]
        == sum(m["per_step_accepted"])
        == sum(j * c for j, c in enumerate(m["acceptance_histogram"]))
        == sum(m["num_accepted_tokens_per_pos"])
    )
    assert m["num_draft_tokens"] == sum(m["per_step_drafted"]) == sum(m["num_draft_tokens_per_pos"])
    by_length = m["acceptance_histogram_by_draft_length"]
    assert {int(k): sum(row) for k, row in by_length.items()} == {
        k: m["per_step_drafted"].count(k) for k in set(m["per_step_drafted"])
    }
    assert all(len(row) == int(k) + 1 for k, row in by_length.items())
    steps, drafted = max(m["num_spec_steps"], 1), max(m["num_draft_tokens"], 1)
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_draft_tokens"] / steps)
    assert m["draft_acceptance_rate"] == pytest.approx(m["num_accepted_draft_tokens"] / drafted)
    acc = m["num_accepted_tokens_per_pos"]
    assert acc == sorted(acc, reverse=True) and len(m["acceptance_rate_per_pos"]) == 3
    # every verify step emits its accepted drafts and one token of the target's (the last may be cut short)
    assert m["num_spec_steps"] + m["num_accepted_draft_tokens"] <= completion_tokens + 3


def test_per_request_spec_decode_metrics(spec, plain):
    """--per-request-spec-decode-metrics detailed (vLLM's flag): each single-sequence response's
    `metrics.speculative_decoding`, also on the last chunk of a stream (the usage chunk when asked for); null for
    several sequences (n > 1, a batch of prompts), as in vLLM; `metrics` null on a server without the flag."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{spec.url}/v1/completions", json=body, timeout=60).json()
    m = r["metrics"]["speculative_decoding"]
    check_spec_metrics(m, r["usage"]["completion_tokens"])
    # the repeated phrase is drafted from and accepted
    assert m["num_spec_steps"] > 0 and m["num_accepted_draft_tokens"] > 0
    for several in ({"n": 2, "seed": 1}, {"prompt": PROMPTS[:2]}):
        r2 = httpx.post(f"{spec.url}/v1/completions", json=body | several, timeout=60).json()
        assert len(r2["choices"]) == 2 and r2["metrics"] == {"speculative_decoding": None}
    # the OpenAI client keeps the extension as an extra field
    c = spec.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=30, temperature=0
    )
    check_spec_metrics(c.model_extra["metrics"]["speculative_decoding"], c.usage.completion_tokens)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 30}
    for path, req in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        for opts in ({"include_usage": True}, None):
            extra = {"stream": True} | ({"stream_options": opts} if opts else {})
            with httpx.stream("POST", f"{spec.url}{path}", json=req | extra, timeout=60) as resp:
                chunks = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
            assert all(c["metrics"] is None for c in chunks[:-1])
            m = chunks[-1]["metrics"]["speculative_decoding"]
            n = sum(len(c["choices"]) for c in chunks)
            check_spec_metrics(m, chunks[-1]["usage"]["completion_tokens"] if opts else n)
    r = httpx.post(f"{plain.url}/v1/completions", json=body, headers=headers, timeout=60).json()
    assert r["metrics"] is None


def test_extract_hidden_states_server(ckpt, tmp_path):
    """`verispec serve --speculative-config '{"method": "extract_hidden_states", ...}' --kv-transfer-config ...`:
    the response carries kv_transfer_params with the saved file, as vLLM's server does."""
    from safetensors.torch import load_file

    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}},
    }
    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "hs")},
    }
    args = [
        ckpt,
        "--max-model-len",
        "128",
        "--speculative-config",
        json.dumps(spec),
        "--kv-transfer-config",
        json.dumps(kv),
    ]
    server = Server(args, tmp_path / "hs.log").wait_ready()
    try:
        body = {"model": ckpt, "prompt": [5, 17, 9, 44], "max_tokens": 1, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        saved = load_file(r.json()["kv_transfer_params"]["hidden_states_path"])
        assert saved["token_ids"].tolist() == [5, 17, 9, 44] and saved["hidden_states"].shape == (4, 2, 64)
        chat = {"model": ckpt, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        assert load_file(r.json()["kv_transfer_params"]["hidden_states_path"])["hidden_states"].shape[1:] == (
            2,
            64,
        )
    finally:
        server.stop()
