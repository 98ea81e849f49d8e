"""The OpenAI-compatible FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /health, /version,
/metrics. Errors always use OpenAI's error JSON.

A request's path: the route here -> serving_completion / serving_chat (validation, prompts, response shapes) ->
serving.ServingContext (context length, fan-out into engine requests) -> async_engine (the engine thread) ->
streaming (server-sent events or the collected final outputs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from verispec import __version__
from verispec.llm import LLM
from verispec.server import protocol as P
from verispec.server.async_engine import AsyncEngine
from verispec.server.errors import error_response, install_error_handlers
from verispec.server.guard import Admission, RequestGuard
from verispec.server.metrics import ServerMetrics
from verispec.server.serving import ServingContext
from verispec.server.serving_chat import create_chat_completion
from verispec.server.serving_completion import create_completion

logger = logging.getLogger("verispec.server")


def build_app(
    llm: LLM,
    served_model_name: str | list[str],
    api_key: str | None = None,
    max_queue: int = 256,
    model_path: str | None = None,
    max_request_body_bytes: int = 4 << 20,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """tool_call_parser: the parser of tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser); None
    refuses "auto", as vLLM without those flags."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    spec = llm.speculative_config
    metrics = ServerMetrics(
        names[0], spec.num_speculative_tokens if spec else 0, llm.engine.stats().num_kv_slots
    )
    engine = AsyncEngine(llm, metrics, max_queue)
    ctx = ServingContext(
        engine,
        llm.tokenizer,
        names,
        llm.max_model_len,
        max_queue + engine.num_slots,
        llm.engine.opts.spec_metrics,
        tool_call_parser,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        method = spec.method if spec else "off"
        logger.info(
            "serving %s (max_model_len=%d, kv slots=%d, speculation=%s)",
            ctx.model_name,
            ctx.max_model_len,
            engine.num_slots,
            method,
        )
        yield
        await asyncio.to_thread(engine.shutdown)

    # no /docs, /redoc or /openapi.json: the API is OpenAI's, and they would describe it to anyone, key or not
    app = FastAPI(
        title="verispec",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.engine, app.state.metrics = engine, metrics
    app.state.admission = admission = Admission()
    app.add_middleware(
        RequestGuard, max_body_bytes=max_request_body_bytes, admission=admission, api_key=api_key
    )
    install_error_handlers(app)
    _add_routes(app, ctx, metrics, model_path)
    return app


def _add_routes(app: FastAPI, ctx: ServingContext, metrics: ServerMetrics, model_path: str | None) -> None:
    """The service routes (open, like vLLM's) and the /v1 routes (behind the API key when one is set: the
    front door, verispec/server/guard.py, checks it)."""
    engine = ctx.engine
    admission = app.state.admission

    @app.get("/health")
    async def health():
        if admission.draining:
            return error_response(503, "The server is shutting down.")
        if not engine.alive:
            return error_response(503, "The engine is not running.")
        return {"status": "ok", **engine.stats()}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        data, ctype = metrics.render()
        return Response(data, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        root = model_path or ctx.model_name
        return P.ModelList(
            data=[P.ModelCard(id=n, root=root, max_model_len=ctx.max_model_len) for n in ctx.names]
        )

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, request: Request):
        return await create_completion(ctx, req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        return await create_chat_completion(ctx, req, request)


async def end_now(app: FastAPI, grace: float) -> None:
    """The second signal: end every request at once (a stream gets an error event and [DONE], any other request
    a 503 error JSON) and give those last responses up to `grace` seconds to be sent."""
    admission, engine = app.state.admission, app.state.engine
    admission.draining = True
    ended = engine.end_all("The server shut down before this request finished.")
    logger.warning("second signal: ending %d requests now and exiting", ended)
    deadline = time.monotonic() + grace
    while admission.active and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def drain(app: FastAPI, timeout: float) -> None:
    """The shutdown (SIGTERM): refuse new requests with 503, let the submitted ones finish for up to `timeout`
    seconds, then end the rest (a stream gets an error event and [DONE], any other request an OpenAI error JSON)
    and wait briefly for those last responses to be sent."""
    admission, engine = app.state.admission, app.state.engine
    admission.draining = True
    logger.info("shutting down: %d requests in flight, waiting up to %.1f s", engine.num_inflight, timeout)
    deadline = time.monotonic() + timeout
    while engine.num_inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if engine.num_inflight:
        logger.warning("ending %d requests still running after --shutdown-timeout", engine.num_inflight)
    await asyncio.to_thread(engine.shutdown)
    deadline = time.monotonic() + 5.0
    while admission.active and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
