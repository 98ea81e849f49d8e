"""The OpenAI-compatible FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /health, /version,
/metrics. Errors always use OpenAI's error JSON."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec import __version__
from verispec.llm import LLM, _child_params
from verispec.outputs import CompletionOutput, Logprob, RequestOutput
from verispec.server import protocol as P
from verispec.server.async_engine import (
    AsyncEngine,
    EngineError,
    EngineRequest,
    QueueFullError,
    RequestAborted,
    RequestGroup,
)
from verispec.server.metrics import ServerMetrics

logger = logging.getLogger("verispec.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


_FIELDS = set(P.CompletionRequest.model_fields) | set(P.ChatCompletionRequest.model_fields)


def _bad_request(e: ValueError) -> APIError:
    msg = str(e)
    m = re.match(r"([a-z_]+) ", msg)  # SamplingParams messages start with the field name
    param = m.group(1) if m and m.group(1) in _FIELDS else None
    return APIError(400, msg, param)


def _error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(status, message, param), status_code=status)


class _Choice:
    """Streaming state of one choice: how much text / how many tokens were already sent."""

    def __init__(self, holdback: int):
        self.holdback = holdback
        self.sent_text = 0
        self.sent_tokens = 0
        self.token_text = 0  # characters of the sent tokens' own texts: the next logprobs text_offset
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


def build_app(
    llm: LLM,
    served_model_name: str | list[str],
    api_key: str | None = None,
    max_queue: int = 256,
    model_path: str | None = None,
) -> FastAPI:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    model_name = names[0]
    k = llm.speculative_config.num_speculative_tokens if llm.speculative_config else 0
    metrics = ServerMetrics(model_name, k, llm.engine.cache.num_slots)
    engine = AsyncEngine(llm, metrics, max_queue)
    tokenizer = llm.tokenizer
    vocab_size = llm.ckpt.config.vocab_size
    max_model_len = llm.max_model_len
    max_children = max_queue + engine.num_slots

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        logger.info(
            "serving %s (max_model_len=%d, kv slots=%d, speculation=%s)",
            model_name,
            max_model_len,
            engine.num_slots,
            llm.speculative_config.method if llm.speculative_config else "off",
        )
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="verispec", version=__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    # ------------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return _error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        parts, param = [], None
        for err in errs[:3]:
            if err.get("type") == "json_invalid":
                return _error_response(
                    400, f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"
                )
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return _error_response(400, "; ".join(parts) or "invalid request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        msg = (
            f"Route {request.method} {request.url.path} not found" if e.status_code == 404 else str(e.detail)
        )
        return _error_response(e.status_code, msg)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        logger.exception("unhandled error")
        return _error_response(500, f"Internal server error: {e!r}")

    # ------------------------------------------------------------------ helpers
    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "Invalid or missing API key: pass it as 'Authorization: Bearer <key>'.")

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def resolve_max_tokens(requested: int | None, prompt_len: int) -> int | None:
        if prompt_len >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"request has {prompt_len} input tokens. Please reduce the length of the input "
                "messages.",
                "prompt",
            )
        room = max_model_len - prompt_len
        if requested is None:
            return room
        if requested >= 1 and requested > room:  # < 1 is rejected by SamplingParams with its own message
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {requested + prompt_len} tokens ({prompt_len} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or "
                "completion.",
                "max_tokens",
            )
        return requested

    def check_ids(ids: list[int]) -> None:
        if not ids:
            raise APIError(400, "The prompt must contain at least one token.", "prompt")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"Token ids {bad[:5]} are out of vocabulary (size {vocab_size}).", "prompt")

    def engine_requests(
        base: str,
        prompts: list[tuple[str | None, list[int]]],
        req: P._SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> list[EngineRequest]:
        out = []
        for i, (text, ids) in enumerate(prompts):
            check_ids(ids)
            try:
                sp = req.sampling_params(resolve_max_tokens(max_tokens, len(ids)), logprobs, prompt_logprobs)
            except ValueError as e:
                raise _bad_request(e) from None
            if sp.stop and tokenizer is None:
                raise APIError(400, "stop strings need a tokenizer", "stop")
            rid = base if len(prompts) == 1 else f"{base}-{i}"
            for j in range(sp.n):  # children as LLM._add makes them: ids f"{rid}_{j}", seeds seed + j
                child = sp if sp.n == 1 else _child_params(sp, j)
                out.append(EngineRequest(rid if sp.n == 1 else f"{rid}_{j}", text, ids, child))
        if len(out) > max_children:
            raise APIError(
                400,
                f"The request asks for {len(out)} sequences (prompts x n); at most {max_children} "
                "are allowed.",
                "n",
            )
        return out

    async def submit(reqs: list[EngineRequest]) -> RequestGroup:
        try:
            return await engine.submit(reqs)
        except QueueFullError as e:
            raise APIError(503, str(e)) from None
        except ValueError as e:
            raise _bad_request(e) from None
        except EngineError as e:
            raise APIError(500, str(e)) from None

    async def collect(request: Request, group: RequestGroup) -> list[RequestOutput]:
        """Wait for all final outputs; abort everything if the client disconnects first."""
        finals: list[RequestOutput | None] = [None] * len(group.request_ids)

        async def run():
            async for i, out in group:
                finals[i] = out

        task = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                raise _ClientGone()
            task.result()
        except EngineError as e:
            raise APIError(500, str(e)) from None
        finally:
            watch.cancel()
            engine.abort(group.request_ids)  # no-op for finished ones
        return finals  # type: ignore[return-value]

    def sse(request: Request, group: RequestGroup, events: AsyncIterator[str]) -> StreamingResponse:
        async def body():
            watch = asyncio.ensure_future(_wait_disconnect(request, lambda: engine.abort(group.request_ids)))
            try:
                async for ev in events:
                    yield ev
            except EngineError as e:
                yield f"data: {json.dumps(P.error_body(500, str(e)))}\n\n"
            except RequestAborted:
                return
            finally:
                watch.cancel()
                engine.abort(group.request_ids)
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    def usage(
        prompts: list[tuple[str | None, list[int]]], outs: list[CompletionOutput | None]
    ) -> P.UsageInfo:
        p = sum(len(ids) for _, ids in prompts)
        c = sum(len(o.token_ids) for o in outs if o is not None)
        return P.UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def running_usage(prompts: list[tuple[str | None, list[int]]], state: list[_Choice]) -> P.UsageInfo:
        p = sum(len(ids) for _, ids in prompts)
        c = sum(st.sent_tokens for st in state)
        return P.UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def holdback(req: P._SamplingFields) -> int:
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        return 0 if req.include_stop_str_in_output or not stop else max(len(s) for s in stop) - 1

    async def stream_events(
        group, req, prompts, state, logprobs, make_choice, make_chunk
    ) -> AsyncIterator[str]:
        """The SSE loop shared by both endpoints: new text (and logprobs) per choice, then the usage chunk."""
        continuous = req.continuous_usage
        async for i, out in group:
            st = state[i]
            text, a, b = st.delta(out)
            if not text and not out.finished and not (logprobs is not None and b > a):
                continue
            c = out.outputs[0]
            entries = c.logprobs[a:b] if logprobs is not None and c.logprobs else None
            # offsets count the tokens' texts, as the non-streamed response does (the sent text lags behind them
            # while a possible stop string is held back)
            choice = make_choice(i, text, entries, st.token_text, c if out.finished else None)
            st.token_text += sum(len(e[next(iter(e))].decoded_token or "") for e in entries or [])
            yield _sse(make_chunk([choice], running_usage(prompts, state) if continuous else None))
        if req.include_usage:
            yield _sse(make_chunk([], usage(prompts, [s.last for s in state])))

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        if not engine.alive:
            return _error_response(503, "The engine is not running.")
        return {"status": "ok", **engine.stats()}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        data, ctype = metrics.render()
        return Response(data, media_type=ctype)

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def models():
        cards = [P.ModelCard(id=n, root=model_path or model_name, max_model_len=max_model_len) for n in names]
        return P.ModelList(data=cards)

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)])
    async def completions(req: P.CompletionRequest, request: Request):
        check_model(req.model)
        if req.echo and (req.stream or tokenizer is None):
            raise APIError(400, "echo is supported without stream and with a tokenizer only", "echo")
        try:
            logprobs = req.requested_logprobs()
        except ValueError as e:
            raise _bad_request(e) from None
        prompts = _completion_prompts(req.prompt, tokenizer)
        rid = P.random_id("cmpl")
        # echo: the prompt leads each choice's text (and its logprobs); max_tokens=0 returns the prompt alone
        echo_only = req.echo and req.max_tokens == 0
        group = await submit(
            engine_requests(
                rid,
                prompts,
                req,
                1 if echo_only else req.max_tokens,
                logprobs,
                logprobs if req.echo else None,
            )
        )
        created, name = int(time.time()), req.model or model_name
        if not req.stream:
            finals = await collect(request, group)
            outs = [f.outputs[0] for f in finals]
            per_prompt = len(finals) // len(prompts)
            choices = []
            for i, (f, o) in enumerate(zip(finals, outs)):
                text, lp = o.text, _completion_logprobs(o.logprobs, 0) if logprobs is not None else None
                if req.echo:
                    ptext, pids = prompts[i // per_prompt]
                    text = (tokenizer.decode(pids) if ptext is None else ptext) + ("" if echo_only else text)
                    if logprobs is not None:
                        lp = _echo_logprobs(
                            pids, f.prompt_logprobs, tokenizer, [] if echo_only else o.logprobs
                        )
                choices.append(
                    P.CompletionChoice(
                        index=i,
                        text=text,
                        finish_reason="length" if echo_only else o.finish_reason,
                        stop_reason=None if echo_only else o.stop_reason,
                        logprobs=lp,
                        prompt_logprobs=P.prompt_logprobs(f.prompt_logprobs)
                        if req.prompt_logprobs is not None
                        else None,
                    )
                )
            return P.CompletionResponse(
                id=rid,
                created=created,
                model=name,
                choices=choices,
                usage=usage(prompts, [None] * len(outs) if echo_only else outs),
                kv_transfer_params=finals[0].kv_transfer_params,
            )

        def choice(i, text, entries, offset, final):
            lp = _completion_logprobs(entries, offset) if entries is not None else None
            return P.CompletionChoice(
                index=i,
                text=text,
                logprobs=lp,
                finish_reason=final.finish_reason if final else None,
                stop_reason=final.stop_reason if final else None,
            )

        def chunk(choices, u):
            return P.CompletionResponse(id=rid, created=created, model=name, choices=choices, usage=u)

        async def events():
            state = [_Choice(holdback(req)) for _ in group.request_ids]
            async for event in stream_events(group, req, prompts, state, logprobs, choice, chunk):
                yield event

        return sse(request, group, events())

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)])
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        check_model(req.model)
        if tokenizer is None:
            raise APIError(400, "chat completions need a tokenizer")
        try:
            logprobs = req.requested_logprobs()
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:
            raise _bad_request(e) from None
        except Exception as e:  # jinja2 TemplateError from the model's template (e.g. roles must alternate)
            raise APIError(400, f"chat template error: {e}", "messages") from None
        prompts = [(text, tokenizer.encode(text, add_special_tokens=False))]
        rid = P.random_id("chatcmpl")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        group = await submit(engine_requests(rid, prompts, req, max_tokens, logprobs))
        created, name = int(time.time()), req.model or model_name
        top = req.top_logprobs or 0
        if not req.stream:
            finals = await collect(request, group)
            outs = [f.outputs[0] for f in finals]
            choices = [
                P.ChatChoice(
                    index=i,
                    message=P.AssistantMessage(content=o.text),
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                    logprobs=_chat_logprobs(o.logprobs, top) if logprobs is not None else None,
                )
                for i, o in enumerate(outs)
            ]
            return P.ChatCompletionResponse(
                id=rid,
                created=created,
                model=name,
                choices=choices,
                usage=usage(prompts, outs),
                prompt_logprobs=P.prompt_logprobs(finals[0].prompt_logprobs),
                kv_transfer_params=finals[0].kv_transfer_params,
            )

        def choice(i, text, entries, offset, final):
            lp = _chat_logprobs(entries, top) if entries is not None else None
            return P.ChatStreamChoice(
                index=i,
                delta=P.DeltaMessage(content=text),
                logprobs=lp,
                finish_reason=final.finish_reason if final else None,
                stop_reason=final.stop_reason if final else None,
            )

        def chunk(choices, u):
            return P.ChatCompletionChunk(id=rid, created=created, model=name, choices=choices, usage=u)

        async def events():
            state = [_Choice(holdback(req)) for _ in group.request_ids]
            for i in range(len(state)):  # vLLM sends the role first, one chunk per choice
                delta = P.DeltaMessage(role="assistant", content="")
                yield _sse(chunk([P.ChatStreamChoice(index=i, delta=delta)], None))
            async for event in stream_events(group, req, prompts, state, logprobs, choice, chunk):
                yield event

        return sse(request, group, events())

    @app.exception_handler(_ClientGone)
    async def _client_gone(_: Request, e: _ClientGone):
        return Response(status_code=499)

    return app


# ---------------------------------------------------------------------------------------------- helpers


class _ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request, on_disconnect: Callable[[], None] | None = None) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if on_disconnect is not None:
                on_disconnect()
            return


def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _completion_prompts(prompt, tokenizer) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [(None, list(prompt))]
    out = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise APIError(400, "text prompts need a tokenizer; send token ids instead", "prompt")
            out.append((p, tokenizer.encode(p)))
        else:
            out.append((None, list(p)))
    return out


_lp = P.json_logprob


def _completion_logprobs(entries: list[dict[int, Logprob]] | None, offset: int) -> P.CompletionLogprobs:
    out = P.CompletionLogprobs()
    sampled_ids = []
    for entry in entries or []:
        # the sampled token is the entry's first key (commit_tokens puts it first)
        tid = next(iter(entry))
        sampled_ids.append(tid)
        tok = entry[tid].decoded_token or ""
        out.tokens.append(tok)
        out.token_logprobs.append(_lp(entry[tid].logprob))
        out.top_logprobs.append({(v.decoded_token or ""): _lp(v.logprob) for v in entry.values()})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def _echo_logprobs(ids: list[int], prompt_lp, tokenizer, generated) -> P.CompletionLogprobs:
    """Completion logprobs of an echoed prompt (its first token has none, as in vLLM), then of the generated
    tokens; text offsets run on through both."""
    out = P.CompletionLogprobs()
    offset = 0
    for i, tid in enumerate(ids):
        entry = prompt_lp[i] if prompt_lp is not None and i < len(prompt_lp) else None
        tok = (
            tokenizer.decode([tid], skip_special_tokens=False)
            if entry is None
            else entry[tid].decoded_token or ""
        )
        out.tokens.append(tok)
        out.text_offset.append(offset)
        out.token_logprobs.append(None if entry is None else _lp(entry[tid].logprob))
        out.top_logprobs.append(
            None if entry is None else {(v.decoded_token or ""): _lp(v.logprob) for v in entry.values()}
        )
        offset += len(tok)
    gen = _completion_logprobs(generated, offset)
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(out, name).extend(getattr(gen, name))
    return out


def _chat_logprobs(entries: list[dict[int, Logprob]] | None, top: int) -> P.ChatLogprobs:
    content = []
    for entry in entries or []:
        tid = next(iter(entry))
        lp = entry[tid]
        tok = lp.decoded_token or ""
        ranked = sorted(
            (v for v in entry.values() if v.rank is not None and v.rank <= top), key=lambda v: v.rank
        )
        tops = [
            P.TopLogprob(
                token=v.decoded_token or "",
                logprob=_lp(v.logprob),
                bytes=list((v.decoded_token or "").encode()),
            )
            for v in ranked[:top]
        ]
        content.append(
            P.ChatTokenLogprob(
                token=tok, logprob=_lp(lp.logprob), bytes=list(tok.encode()), top_logprobs=tops
            )
        )
    return P.ChatLogprobs(content=content)
