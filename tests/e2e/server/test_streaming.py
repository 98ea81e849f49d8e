"""Delivering outputs (verispec/server/streaming.py): 32 concurrent streams uncorrupted by batching, and a client
that disconnects aborts its requests and frees their KV slots."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest

from tests.helpers import API_KEY, PROMPTS, greedy, wait_for


def test_32_concurrent_streaming_clients(plain, llm):
    prompts = [f"{PROMPTS[i % 4]} {' '.join(['word'] * (i % 7))} #{i}" for i in range(32)]
    lens = [8 + (i * 5) % 25 for i in range(32)]
    refs = llm.generate(prompts, [greedy(n) for n in lens], use_tqdm=False)
    before = plain.metrics()

    async def one(client, i):
        text, usage = "", None
        stream = await client.completions.create(
            model="tiny",
            prompt=prompts[i],
            max_tokens=lens[i],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    # invalid requests interleaved with the good ones must not disturb them
    async def bad(client):
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="tiny", prompt="x", max_tokens=-3)
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="tiny", prompt=[5] * 300, max_tokens=4)

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{plain.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        results = await asyncio.gather(*[one(client, i) for i in range(32)], *[bad(client) for _ in range(4)])
        await client.close()
        return results[:32]

    results = asyncio.run(main())
    for (text, usage), ref, n in zip(results, refs, lens):
        # not corrupted by batching with 31 others
        assert text == ref.outputs[0].text
        assert usage.completion_tokens == n
    after = plain.metrics()

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for _, u in results)
    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for _, u in results)
    assert delta("vllm:request_success_total", (("finished_reason", "length"),)) == 32
    assert delta("vllm:e2e_request_latency_seconds_count") == 32
    assert delta("vllm:time_to_first_token_seconds_count") == 32
    assert after[("verispec:kv_cache_free_slots", ())] == 8 and after[("vllm:num_requests_running", ())] == 0


def test_disconnect_aborts_and_frees_cache(plain):
    client = plain.client()
    aborted0 = plain.metric("vllm:request_aborted_total")
    success0 = plain.metric("vllm:request_success_total", finished_reason="abort")
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        max_tokens=230,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    next(it), next(it)
    assert plain.metric("verispec:kv_cache_free_slots") == 7
    # client goes away mid-stream
    stream.close()
    wait_for(lambda: plain.metric("vllm:request_aborted_total") == aborted0 + 1, what="streaming abort")
    assert plain.metric("vllm:request_success_total", finished_reason="abort") == success0 + 1
    assert (
        plain.metric("verispec:kv_cache_free_slots") == 8 and plain.metric("vllm:num_requests_running") == 0
    )
    assert httpx.get(f"{plain.url}/health").json()["free_kv_slots"] == 8

    # non-streaming (n=4): the client drops the connection while the request runs
    body = json.dumps(
        {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 230, "n": 4, "ignore_eos": True}
    ).encode()
    with socket.create_connection(("127.0.0.1", plain.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: httpx.get(f"{plain.url}/health").json()["running"] == 4, what="request running")
    wait_for(lambda: plain.metric("vllm:request_aborted_total") == aborted0 + 5, what="non-streaming abort")
    assert plain.metric("verispec:kv_cache_free_slots") == 8
