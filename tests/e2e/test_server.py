"""`verispec serve` end to end: the real server process on a loopback port, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.tiny_models import write_tiny_checkpoint
from verispec import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-key"
# the plain server's --max-request-body-bytes (set in its YAML file)
BODY_LIMIT = 1 << 20
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
FIXED_K_NGRAM = NGRAM | {"enable_adaptive_verification": False}
PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "import numpy as np\nx = np.arange(10)\n",
    "Speculative decoding drafts tokens",
]


# ---------------------------------------------------------------------------------------------- launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "verispec.server.cli", *args, "--port", str(self.port)]
        self._log_file = open(log, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def wait_ready(self, timeout: float = 180.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()

    def client(self, api_key: str = API_KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[tuple, float]:
        """{(sample name, sorted labels without model_name): value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def metric(self, name: str, **labels) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(cond, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("server") / "llama", "llama"))


@pytest.fixture(scope="module")
def servers(ckpt, tmp_path_factory):
    """Both tiny servers, started in parallel: plain (config file + flag overrides, API key) and ngram."""
    d = tmp_path_factory.mktemp("serve")
    plain_cfg = d / "plain.yaml"
    plain_cfg.write_text(
        f"model: {ckpt}\nserved-model-name: tiny\nmax_model_len: 256\nmax-num-seqs: 4\n"
        f"api-key: {API_KEY}\ndisable-uvicorn-access-log: true\nmax-request-body-bytes: {BODY_LIMIT}\n"
    )
    # nested mapping for the speculative config; fixed K: the server's own planner times its steps for real (the
    # suite's frozen step cost is this process's), and on a random tiny model it would rightly verify little, while
    # these tests check what verified drafts report
    spec_cfg = d / "spec.yaml"
    spec_cfg.write_text(
        "served_model_name: [tiny, tiny-alias]\nmax-model-len: 256\nmax-num-seqs: 2\n"
        "max-queue: 1\nspeculative-config:\n  method: ngram\n  num_speculative_tokens: 3\n"
        "  prompt_lookup_max: 3\n  enable_adaptive_verification: false\nper-request-spec-decode-metrics: detailed\n"
    )
    plain = Server(["--config", str(plain_cfg), "--max-num-seqs", "8"], d / "plain.log")
    spec = Server([ckpt, "--config", str(spec_cfg)], d / "spec.log")
    try:
        yield {"plain": plain.wait_ready(), "spec": spec.wait_ready()}
    finally:
        plain.stop()
        spec.stop()


@pytest.fixture(scope="module")
def plain(servers) -> Server:
    return servers["plain"]


@pytest.fixture(scope="module")
def spec(servers) -> Server:
    return servers["spec"]


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    """The offline reference (no speculation)."""
    return LLM(ckpt, max_model_len=256, max_num_seqs=8)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---------------------------------------------------------------------------------------------- basics


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


# ---------------------------------------------------------------------------------------------- concurrency


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


def test_overload_returns_503(spec):
    """2 KV slots + --max-queue 1: three long requests fit, the fourth is refused with 503."""
    client = spec.client()
    msgs = [{"role": "user", "content": "count"}]
    streams = []
    try:
        for _ in range(3):
            s = client.chat.completions.create(
                model="tiny",
                messages=msgs,
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            # the role chunk: the request is in
            next(iter(s))
            streams.append(s)
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5)
        assert e.value.status_code == 503 and "overloaded" in e.value.message
        assert e.value.body["type"] == "ServiceUnavailableError"
    finally:
        for s in streams:
            s.close()
    wait_for(lambda: spec.metric("verispec:kv_cache_free_slots") == 2, what="slots freed")
    r = client.chat.completions.create(model="tiny-alias", messages=msgs, max_tokens=3)
    assert r.usage.completion_tokens <= 3


# ---------------------------------------------------------------------------------------------- errors


ERROR_CASES = [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 3}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": "many"}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": [7] * 300}, 400, "maximum context length"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 500}, 400, "maximum context length"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 0},
        400,
        "max_tokens",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": [99999]}, 400, "vocabulary"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [True, False]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1.0, 2.0]}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "The model `gpt-4` does not exist."),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": [""]},
        400,
        "stop",
    ),
    ("/v1/no-such-route", {}, 404, "not found"),
]
# hostile input: (path, body, message part, the param the error names)
HOSTILE = [
    ("/v1/completions", {"model": "tiny", "prompt": "a\ud800b"}, "lone UTF-16 surrogate", "prompt"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": ["ok", "\udfff"]},
        "prompt[1] is not valid Unicode",
        "prompt",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}},
        "stream_options can only be set when stream is true",
        "stream_options",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "hacker", "content": "hi"}]},
        "unknown role 'hacker'",
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
        "content[0]['text'] is not valid Unicode",
        "messages",
    ),
]
MSG = [{"role": "user", "content": "hi"}]
# fields that would change the output: a 400 naming them, never silently ignored
UNSUPPORTED = [
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": MSG, "response_format": {"type": "json_object"}},
        "response_format",
    ),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": MSG, "bad_words": "x"}, "bad_words"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages",
    ),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
]


@pytest.mark.parametrize("path,body,field", UNSUPPORTED)
def test_unsupported_fields_are_400_naming_them(plain, path, body, field):
    r = httpx.post(
        f"{plain.url}{path}",
        json={"model": "tiny", "max_tokens": 2, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


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


def test_neutral_values_of_unsupported_fields_are_accepted(plain):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "logit_bias": {}, "best_of": 1, "tools": None}
    body |= {"response_format": {"type": "text"}}
    r = httpx.post(f"{plain.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body,status,needle", ERROR_CASES)
def test_error_cases(plain, path, body, status, needle):
    r = httpx.post(
        f"{plain.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert needle in err["message"]


def test_hostile_input_names_the_field_without_traceback(plain):
    """Lone surrogates (escaped or as raw UTF-8 bytes), stream_options without stream, an unknown chat role: a
    400 naming the field, and no traceback in the server log."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for path, body, needle, param in HOSTILE:
        r = httpx.post(f"{plain.url}{path}", content=json.dumps(body), headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert needle in r.json()["error"]["message"]
    raw = [
        ("/v1/completions", b'{"model": "tiny", "prompt": "x\xed\xa0\x80y"}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xb0\x80"}]}', "messages"),
    ]
    for path, body, param in raw:
        r = httpx.post(f"{plain.url}{path}", content=body, headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "surrogate" in r.json()["error"]["message"]
    # invalid UTF-8 (not a surrogate): still a 400, never a 500
    r = httpx.post(f"{plain.url}/v1/completions", content=b'{"prompt": "\xff"}', headers=headers, timeout=30)
    assert r.status_code == 400
    assert "Traceback" not in plain.log.read_text()


def test_body_limit_and_context_length_checked_before_parsing(plain):
    """A 20 MB body is refused with 413 in OpenAI's error JSON at once (Content-Length or chunked), a prompt
    that cannot fit the context is refused before it is tokenized, and /health answers all along."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    huge = b'{"model": "tiny", "prompt": "' + b"a" * 20_000_000 + b'"}'
    health, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            t = time.monotonic()
            code = httpx.get(f"{plain.url}/health", timeout=10).status_code
            health.append((code, time.monotonic() - t))
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        t = time.monotonic()
        r = httpx.post(f"{plain.url}/v1/completions", content=huge, headers=headers, timeout=60)
        took = time.monotonic() - t
        assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
        assert str(BODY_LIMIT) in r.json()["error"]["message"]
        # well under a second alone; generous here (2 shared cores)
        assert took < 5, took

        def chunks():
            for _ in range(20):
                yield b"a" * 1_000_000

        r = httpx.post(f"{plain.url}/v1/completions", content=chunks(), headers=headers, timeout=60)
        assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
        # under the body limit, but more bytes than 256 tokens can hold: refused before tokenizing
        body = {"model": "tiny", "prompt": "word " * 200_000}
        r = httpx.post(f"{plain.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "maximum context length is 256 tokens" in r.json()["error"]["message"]
        body = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 200_000}]}
        r = httpx.post(f"{plain.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join()
    assert health and all(code == 200 for code, _ in health), health
    r = plain.client().completions.create(model="tiny", prompt="still alive", max_tokens=3)
    assert r.usage.completion_tokens <= 3


def test_sigterm_drains_then_ends_the_rest(tmp_path):
    """SIGTERM: new requests get 503 at once; a request that finishes within --shutdown-timeout completes; the
    rest end properly (a stream with an error event and [DONE], a plain request with OpenAI's error JSON); the
    process exits with no traceback in its log."""
    # a model wide and deep enough that its steps take milliseconds on any machine
    slow = write_tiny_checkpoint(
        tmp_path / "slow", "llama", num_layers=12, hidden_size=512, intermediate_size=2048
    )
    args = [str(slow), "--max-model-len", "512", "--max-num-seqs", "24", "--shutdown-timeout", "3"]
    args.append("--disable-uvicorn-access-log")
    srv = Server(args, tmp_path / "drain.log").wait_ready()
    url, results, lines = srv.url, {}, []
    # 8 sequences of 480 tokens with logprobs each: far more than the 1 s drain allows on any machine
    long_body = {
        "prompt": "count",
        "max_tokens": 480,
        "ignore_eos": True,
        "temperature": 0,
        "n": 8,
        "logprobs": 5,
    }

    def post(name: str, body: dict) -> None:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        results[name] = (r.status_code, r.json())

    def stream() -> None:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=long_body | {"stream": True}, timeout=120
        ) as r:
            lines.extend(x for x in r.iter_lines() if x)

    threads = [
        threading.Thread(target=stream),
        threading.Thread(target=post, args=("long", long_body)),
        threading.Thread(target=post, args=("short", long_body | {"max_tokens": 4, "n": 1})),
    ]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(lines) >= 2, 60, "the stream's first tokens")
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, 10, "draining /health")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        # a request already admitted before the signal still runs
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
        for t in threads:
            t.join(60)
        srv.proc.wait(30)
        took = time.monotonic() - t0
    finally:
        srv.stop()
    status, body = results["short"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    status, body = results["long"]
    assert status == 503 and body["error"]["code"] == 503 and "shut down" in body["error"]["message"], body
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: ") :])
    assert last["error"]["code"] == 503, lines[-3:]
    # the long requests ran into the 3 s timeout; everything ended soon after it
    assert 2.5 < took < 20, took
    log = (tmp_path / "drain.log").read_text()
    assert "Traceback" not in log and re.search(r"ending \d+ requests", log), log[-3000:]


def check_spec_metrics(m: dict, completion_tokens: int) -> None:
    """The figures of one response's speculation agree with each other and with its tokens."""
    assert m["num_spec_tokens"] == 3 and m["num_spec_steps"] == sum(m["acceptance_histogram"])
    assert (
        m["num_accepted_draft_tokens"] == sum(m["per_step_accepted"]) == sum(m["num_accepted_tokens_per_pos"])
    )
    assert m["num_draft_tokens"] == sum(m["num_draft_tokens_per_pos"])
    steps, drafted = max(m["num_spec_steps"], 1), max(m["num_draft_tokens"], 1)
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_draft_tokens"] / steps)
    assert m["draft_acceptance_rate"] == pytest.approx(m["num_accepted_draft_tokens"] / drafted)
    acc = m["num_accepted_tokens_per_pos"]
    assert acc == sorted(acc, reverse=True) and len(m["acceptance_rate_per_pos"]) == 3
    # every verify step emits its accepted drafts and one token of the target's (the last may be cut short)
    assert m["num_spec_steps"] + m["num_accepted_draft_tokens"] <= completion_tokens + 3


def test_per_request_spec_decode_metrics(spec, plain):
    """--per-request-spec-decode-metrics detailed (vLLM's flag): each response's `metrics.speculative_decoding`,
    also on the last chunk of a stream; absent on a server without the flag."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{spec.url}/v1/completions", json=body, timeout=60).json()
    m = r["metrics"]["speculative_decoding"]
    check_spec_metrics(m, r["usage"]["completion_tokens"])
    # the repeated phrase is drafted from and accepted
    assert m["num_spec_steps"] > 0 and m["num_accepted_draft_tokens"] > 0
    r2 = httpx.post(f"{spec.url}/v1/completions", json=body | {"n": 2, "seed": 1}, timeout=60).json()
    check_spec_metrics(r2["metrics"]["speculative_decoding"], r2["usage"]["completion_tokens"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 30}
    r = httpx.post(f"{spec.url}/v1/chat/completions", json=chat | {"temperature": 0}, timeout=60).json()
    check_spec_metrics(r["metrics"]["speculative_decoding"], r["usage"]["completion_tokens"])
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


def test_errors_through_openai_client(plain):
    client = plain.client()
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        plain.client(api_key="wrong").models.list()
    r = httpx.post(
        f"{plain.url}/v1/completions",
        content=b"{not json",
        timeout=10,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    # no key
    assert httpx.get(f"{plain.url}/v1/models").status_code == 401
    assert (
        httpx.get(f"{plain.url}/v1/models", headers={"Authorization": "Bearer nope"}).json()["error"]["code"]
        == 401
    )
    # not behind the key, like vLLM
    assert httpx.get(f"{plain.url}/metrics").status_code == 200
    # the server survived
    r = client.completions.create(model="tiny", prompt="still alive", max_tokens=3)
    assert r.usage.completion_tokens <= 3


def test_engine_step_failure_only_fails_that_batch(ckpt):
    """In-process: a step that raises fails the running requests; the engine thread keeps serving."""
    from verispec.server.async_engine import AsyncEngine, EngineError, EngineRequest

    local = LLM(ckpt, max_model_len=64, max_num_seqs=2)
    real_step, calls = local.engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_step()

    local.engine.step = flaky_step

    async def main():
        ae = AsyncEngine(local, None, max_queue=4)
        ae.start()
        try:
            g = await ae.submit([EngineRequest("a", None, [5, 6, 7], greedy(6))])
            with pytest.raises(EngineError, match="boom"):
                async for _ in g:
                    pass
            with pytest.raises(ValueError, match="maximum model length"):
                await ae.submit([EngineRequest("b", None, [5] * 80, greedy(4))])
            g = await ae.submit([EngineRequest("c", None, [5, 6, 7], greedy(6))])
            outs = [out async for _, out in g]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
            assert local.engine.cache.num_free == 2 and not local.engine.requests
        finally:
            ae.shutdown()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_config_resolution(tmp_path, monkeypatch):
    import argparse

    from verispec.cli import build_parser
    from verispec.server.cli import add_serve_args, resolve_config

    monkeypatch.setenv("VERISPEC_API_KEY", "from-env")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        "port: 9001\nmax_num_seqs: 3\nspeculative-config:\n  method: ngram\n"
        "  num_speculative_tokens: 2\nserved-model-name: a\n"
    )
    p = argparse.ArgumentParser()
    add_serve_args(p)
    cfg = resolve_config(p.parse_args(["m", "--config", str(cfg_file), "--port", "9002"]))
    assert (cfg.engine.model, cfg.engine.max_num_seqs) == ("m", 3)
    assert (cfg.port, cfg.served_model_name) == (9002, ["a"])
    assert cfg.engine.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert cfg.api_key == "from-env" and cfg.host == "127.0.0.1"
    cfg = resolve_config(
        p.parse_args(["--config", str(cfg_file), "-sc", json.dumps(NGRAM), "--api-key", "k"])
    )
    assert cfg.engine.speculative_config == NGRAM and cfg.api_key == "k"
    assert cfg.engine.model == "smollm2-135m-instruct"
    bad = tmp_path / "bad.yaml"
    for text, needle in [
        ("max_num_seq: 3\n", "unknown option"),
        ("port: eighty\n", "integer"),
        ("speculative-config: [1]\n", "mapping"),
        ("- a\n", "mapping"),
        ("a: [\n", "YAML"),
    ]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=needle):
            resolve_config(p.parse_args(["--config", str(bad)]))
    # the main CLI's subcommand
    args = build_parser().parse_args(["serve", "m", "--port", "1234", "-sc", "{}"])
    assert args.port == 1234 and callable(args.func)


def test_cli_bad_flags_exit_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_option: 1\n")
    cases = [
        ["--port", "eighty"],
        ["m", "-sc", "{not json"],
        ["m", "--config", str(bad)],
        [str(tmp_path / "missing-model")],
        ["m", "--per-request-spec-decode-metrics", "summary"],
        ["m", "--shutdown-timeout", "-1"],
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "verispec.server.cli", *c],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for c in cases
    ]
    for c, proc in zip(cases, procs):
        out, err = proc.communicate(timeout=120)
        lines = [x for x in err.splitlines() if x.strip()]
        assert proc.returncode == 2, (c, err)
        assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in err, (c, err)


def test_spec_decode_log_line_in_server_log(spec):
    """vLLM's periodic 'SpecDecoding metrics' line (every 10 s while drafting) lands in the server log."""
    client = spec.client()
    deadline = time.monotonic() + 30
    while "SpecDecoding metrics:" not in spec.log.read_text() and time.monotonic() < deadline:
        client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
        )
        time.sleep(0.5)
    assert "SpecDecoding metrics: Mean acceptance length" in spec.log.read_text()


# ---------------------------------------------------------------------------------------------- SmolLM2


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
