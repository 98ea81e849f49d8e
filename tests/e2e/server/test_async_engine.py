"""The async front end (verispec/server/async_engine.py): a full queue is a 503, and a failing engine step fails only
the batch it ran."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from tests.helpers import greedy, wait_for
from verispec import LLM


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


def test_bad_words_are_tokenized_off_the_engine_thread(ckpt, monkeypatch):
    """A request's bad_words are tokenized by the front end (ServingContext.engine_requests, in a worker thread),
    never by the engine thread that steps every request; the engine applies them all the same."""
    from verispec.server import protocol as P
    from verispec.server.async_engine import AsyncEngine
    from verispec.server.serving import ServingContext

    local = LLM(ckpt, max_model_len=64, max_num_seqs=2)
    prompt = [5, 6, 7, 8]
    words = ["a", "b c", "hello"]
    ref = local.generate([{"prompt_token_ids": prompt}], greedy(8, bad_words=words), use_tqdm=False)[0]
    threads: list[str] = []
    real_encode = local.tokenizer.encode

    def encode(*args, **kw):
        threads.append(threading.current_thread().name)
        return real_encode(*args, **kw)

    monkeypatch.setattr(local.tokenizer, "encode", encode)

    async def main() -> list:
        ae = AsyncEngine(local, None, max_queue=4)
        ae.start()
        try:
            ctx = ServingContext(ae, local.tokenizer, ["tiny"], 64, 6)
            req = P.CompletionRequest(prompt=prompt, temperature=0, ignore_eos=True, bad_words=words)
            reqs = await asyncio.to_thread(ctx.engine_requests, "r", [(None, prompt)], req, 8, None)
            return [out async for _, out in await ae.submit(reqs)]
        finally:
            ae.shutdown()

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert threads and "verispec-engine" not in threads, threads
