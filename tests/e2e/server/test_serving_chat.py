"""POST /v1/chat/completions (verispec/server/serving_chat.py): greedy chat equals offline decoding, streamed or not,
on the tiny checkpoint and on the real SmolLM2."""

from __future__ import annotations

import json
import threading

import pytest

from tests.helpers import FIXED_K_NGRAM, PROMPTS, Server, greedy
from verispec import LLM, SamplingParams


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_chat_greedy_equal_offline(which, servers, llm):
    client = servers[which].client()
    messages = [{"role": "system", "content": "You edit code."}, {"role": "user", "content": PROMPTS[0]}]
    ref = llm.chat(messages, greedy(20), use_tqdm=False)[0]
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 20
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        # vLLM's extension
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 20
    # tokens delivered so far, in every chunk
    so_far = [c.usage.completion_tokens for c in chunks[1:-1]]
    assert so_far == sorted(so_far) and so_far[-1] == 20


@pytest.mark.slow
def test_smollm2_chat_with_and_without_speculation(smollm2_gguf_file, tmp_path):
    """The real model: the ngram-speculating server's greedy chat equals offline decoding without speculation."""
    server = Server(
        # fixed K: the server process profiles its step cost for real, and this test needs drafts to run
        [
            "smollm2-135m-instruct",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "2",
            "-sc",
            json.dumps(FIXED_K_NGRAM),
        ],
        tmp_path / "smollm2.log",
    )
    result: dict = {}

    # load the reference while the server starts
    def offline():
        ref_llm = LLM("smollm2-135m-instruct", max_model_len=512, max_num_seqs=2)
        result["ref"] = ref_llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[
            0
        ]

    messages = [{"role": "user", "content": "Repeat exactly: def add(a, b): return a + b"}]
    t = threading.Thread(target=offline)
    t.start()
    try:
        server.wait_ready()
        r = server.client().chat.completions.create(
            model="smollm2-135m-instruct", messages=messages, max_tokens=10, temperature=0
        )
        t.join()
        ref = result["ref"].outputs[0]
        assert r.choices[0].message.content == ref.text and r.choices[0].message.content
        assert r.usage.completion_tokens == len(ref.token_ids)
        # speculation really ran
        assert server.metric("vllm:spec_decode_num_drafts_total") > 0
    finally:
        t.join()
        server.stop()
