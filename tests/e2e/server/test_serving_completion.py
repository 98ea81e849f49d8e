"""POST /v1/completions (verispec/server/serving_completion.py) on a real `verispec serve` process, driven by the
official openai client: greedy and seeded outputs equal offline decoding, stop strings, logprobs, echo."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import API_KEY, PROMPTS, greedy
from verispec import SamplingParams

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_completions_greedy_equal_offline(which, servers, llm):
    srv = servers[which]
    client = srv.client()
    for i, prompt in enumerate(PROMPTS):
        n = 12 + 5 * i
        ref = llm.generate(prompt, greedy(n), use_tqdm=False)[0].outputs[0]
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == len(ref.token_ids) == n
        assert r.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=n,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    # token-id prompts
    ids = llm.tokenizer.encode(PROMPTS[0])
    r = client.completions.create(
        model="tiny", prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (
        r.choices[0].text
        == llm.generate({"prompt_token_ids": ids}, greedy(10), use_tqdm=False)[0].outputs[0].text
    )
    if which == "spec":
        m = srv.metrics()
        drafts = m[("vllm:spec_decode_num_drafts_total", ())]
        draft_tokens = m[("vllm:spec_decode_num_draft_tokens_total", ())]
        accepted = m[("vllm:spec_decode_num_accepted_tokens_total", ())]
        per_pos = [
            m[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
            for i in range(3)
        ]
        assert drafts > 0 and draft_tokens >= drafts and 0 <= accepted <= draft_tokens
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_n_seeds_and_stop_strings(plain, llm):
    client = plain.client()
    prompt = PROMPTS[1]
    ref = llm.generate(
        prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0]
    kw = dict(
        model="tiny",
        prompt=prompt,
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=16,
        extra_body={"ignore_eos": True},
    )
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.text for o in ref.outputs]
    assert r.usage.completion_tokens == 48
    # seeded
    assert [c.text for c in client.completions.create(**kw).choices] == [o.text for o in ref.outputs]
    texts = ["", "", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [o.text for o in ref.outputs]

    free = llm.generate(prompt, greedy(40), use_tqdm=False)[0].outputs[0].text
    stop = next(
        free[i : i + 3]
        for i in range(4, len(free) - 3)
        if free[i : i + 3].strip() and free.index(free[i : i + 3]) == i
    )
    want = free[: free.index(stop)]
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        stop=[stop, "@@@@"],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    )
    # the stop string never leaks, not even partially
    assert streamed == want


def test_logprobs(plain):
    client = plain.client()
    r = client.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    # streamed with a stop string (its tail is held back): the same offsets, chunk by chunk
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=1, stop=["zzz"])
    whole = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].logprobs
    chunks = client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
    offsets = [
        o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == whole.text_offset and len(offsets) == 8
    c = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_logit_bias_and_allowed_token_ids(plain, llm):
    client = plain.client()
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    r = client.completions.create(**kw, logit_bias={"7": 100}, extra_body={"ignore_eos": True})
    off = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={7: 100.0})
    assert r.choices[0].text == llm.generate(PROMPTS[0], off)[0].outputs[0].text
    r = client.completions.create(**kw, extra_body={"ignore_eos": True, "allowed_token_ids": [11, 12]})
    off = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, allowed_token_ids=[11, 12])
    assert r.choices[0].text == llm.generate(PROMPTS[0], off)[0].outputs[0].text


def test_prompt_logprobs(plain, llm):
    """vLLM's prompt_logprobs: one entry per prompt token (null first), keyed by token id, as the offline API."""
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    r = httpx.post(f"{plain.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    assert len(got) == len(ref.prompt_token_ids) == r.json()["usage"]["prompt_tokens"] and got[0] is None
    for g, e in zip(got[1:], ref.prompt_logprobs[1:]):
        assert [int(k) for k in g] == list(e)
        assert [v["logprob"] for v in g.values()] == pytest.approx([v.logprob for v in e.values()], abs=1e-5)
    chat = {"model": "tiny", "messages": MSG, "max_tokens": 2, "prompt_logprobs": 0}
    r = httpx.post(
        f"{plain.url}/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert r.status_code == 200 and r.json()["prompt_logprobs"][0] is None
    assert len(r.json()["prompt_logprobs"]) == r.json()["usage"]["prompt_tokens"]


def test_echo(plain, llm):
    """echo: the prompt leads the text; with logprobs its tokens lead too (the first without a logprob); with
    max_tokens=0 only the prompt comes back (what evaluation harnesses send to score a text)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": PROMPTS[0], "temperature": 0, "echo": True, "logprobs": 1}
    r = httpx.post(f"{plain.url}/v1/completions", json={**body, "max_tokens": 0}, headers=headers).json()
    ref = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, ignore_eos=True)
    )[0]
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == PROMPTS[0] and r["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(ref.prompt_token_ids) and lp["token_logprobs"][0] is None
    expected = [e[t].logprob for e, t in zip(ref.prompt_logprobs[1:], ref.prompt_token_ids[1:])]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    r = httpx.post(
        f"{plain.url}/v1/completions", json={**body, "max_tokens": 3, "ignore_eos": True}, headers=headers
    ).json()
    assert r["choices"][0]["text"] == PROMPTS[0] + ref.outputs[0].text
    assert len(r["choices"][0]["logprobs"]["tokens"]) == len(ref.prompt_token_ids) + 3
    r = httpx.post(
        f"{plain.url}/v1/completions", json={**body, "max_tokens": 2, "stream": True}, headers=headers
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
