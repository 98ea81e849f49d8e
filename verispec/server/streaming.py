"""Delivering a request group's outputs: server-sent events for `stream: true`, or all final outputs at once.

Either way a client that disconnects aborts its engine requests (their KV slots are freed at once), and an engine
failure or a shutdown ends the response properly: an OpenAI error JSON, or an error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from verispec.outputs import CompletionOutput, Logprob, RequestOutput
from verispec.server import protocol as P
from verispec.server.async_engine import AsyncEngine, EngineError, RequestAborted, RequestGroup
from verispec.server.errors import APIError, ClientGone, error_event

Prompts = list[tuple[str | None, list[int]]]


class ChoiceState:
    """Streaming state of one choice: how much text / how many tokens were already sent."""

    def __init__(self, holdback: int):
        self.holdback = holdback
        self.sent_text = 0
        self.sent_tokens = 0
        # characters of the sent tokens' own texts: the next logprobs text_offset
        self.token_text = 0
        self.last: CompletionOutput | None = None

    def delta(self, out: RequestOutput) -> tuple[str, int, int]:
        """New text since the last event (stop-string-sized tail held back until finished), new token range."""
        c = out.outputs[0]
        self.last = c
        upto = len(c.text) if out.finished else max(self.sent_text, len(c.text) - self.holdback)
        text = c.text[self.sent_text : upto]
        self.sent_text = max(self.sent_text, upto)
        start, self.sent_tokens = self.sent_tokens, len(c.token_ids)
        return text, start, self.sent_tokens


def holdback(req: P._SamplingFields) -> int:
    """Characters held back while streaming: a stop string may still complete over them."""
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return 0 if req.include_stop_str_in_output or not stop else max(len(s) for s in stop) - 1


def usage(prompts: Prompts, outs: list[CompletionOutput | None]) -> P.UsageInfo:
    p = sum(len(ids) for _, ids in prompts)
    c = sum(len(o.token_ids) for o in outs if o is not None)
    return P.UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def running_usage(prompts: Prompts, state: list[ChoiceState]) -> P.UsageInfo:
    p = sum(len(ids) for _, ids in prompts)
    c = sum(st.sent_tokens for st in state)
    return P.UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def token_text(entry: dict[int, Logprob]) -> str:
    """The sampled token's text (the entry's first key: commit_tokens puts it first)."""
    return entry[next(iter(entry))].decoded_token or ""


async def stream_events(
    group: RequestGroup,
    req: P._SamplingFields,
    prompts: Prompts,
    logprobs: int | None,
    make_choice: Callable,
    make_chunk: Callable,
    response_metrics: Callable[[list], dict | None] = lambda finals: None,
) -> AsyncIterator[str]:
    """The SSE loop shared by both endpoints: new text (and logprobs) per choice, then the usage chunk. The last
    chunk (the usage chunk, or else the one finishing the last choice) carries response_metrics(final outputs).

    make_choice(index, text, logprob entries, text offset, final output or None), None to send nothing (only
    without logprob entries or a final output); make_chunk(choices, usage, metrics)."""
    state = [ChoiceState(holdback(req)) for _ in group.request_ids]
    finals: list[RequestOutput | None] = [None] * len(state)
    async for i, out in group:
        st = state[i]
        if out.finished:
            finals[i] = out
        text, a, b = st.delta(out)
        if not text and not out.finished and not (logprobs is not None and b > a):
            continue
        c = out.outputs[0]
        entries = c.logprobs[a:b] if logprobs is not None and c.logprobs else None
        # offsets count the tokens' texts, as the non-streamed response does (the sent text lags behind them
        # while a possible stop string is held back)
        choice = make_choice(i, text, entries, st.token_text, c if out.finished else None)
        if choice is None:
            continue
        st.token_text += sum(len(token_text(e)) for e in entries or [])
        last = not req.include_usage and all(f is not None for f in finals)
        u = running_usage(prompts, state) if req.continuous_usage else None
        yield sse(make_chunk([choice], u, response_metrics(finals) if last else None))
    if req.include_usage:
        yield sse(make_chunk([], usage(prompts, [s.last for s in state]), response_metrics(finals)))


def sse_response(
    request: Request, engine: AsyncEngine, group: RequestGroup, events: AsyncIterator[str]
) -> StreamingResponse:
    """Stream the events, then `[DONE]`; an engine failure or shutdown sends an error event first."""

    async def body():
        watch = asyncio.ensure_future(wait_disconnect(request, lambda: engine.abort(group.request_ids)))
        try:
            async for ev in events:
                yield ev
        except EngineError as e:
            yield error_event(e.status, str(e))
        except RequestAborted:
            return
        finally:
            watch.cancel()
            engine.abort(group.request_ids)
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def collect(request: Request, engine: AsyncEngine, group: RequestGroup) -> list[RequestOutput]:
    """Wait for all final outputs; abort everything if the client disconnects first."""
    finals: list[RequestOutput | None] = [None] * len(group.request_ids)

    async def run():
        async for i, out in group:
            finals[i] = out

    task = asyncio.ensure_future(run())
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise ClientGone()
        task.result()
    except EngineError as e:
        raise APIError(e.status, str(e)) from None
    finally:
        watch.cancel()
        # a no-op for the finished ones
        engine.abort(group.request_ids)
    return finals  # type: ignore[return-value]


async def wait_disconnect(request: Request, on_disconnect: Callable[[], None] | None = None) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if on_disconnect is not None:
                on_disconnect()
            return
