"""Every error the server answers, in OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.server import protocol as P

logger = logging.getLogger("verispec.server")

_FIELDS = set(P.CompletionRequest.model_fields) | set(P.ChatCompletionRequest.model_fields)


class APIError(Exception):
    """An HTTP error answered as OpenAI's error JSON; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class ClientGone(Exception):
    """The client disconnected before its response was ready (answered 499, which nobody reads)."""


def bad_request(e: ValueError) -> APIError:
    """A ValueError from request validation as a 400 naming the field: protocol.FieldError's, or the one the
    engine's and SamplingParams' messages start with (the engine's prompt_token_ids is the request's prompt)."""
    msg = str(e)
    if isinstance(e, P.FieldError):
        return APIError(400, msg, e.field)
    m = re.match(r"([a-z_]+) ", msg)
    name = {"prompt_token_ids": "prompt"}.get(m.group(1), m.group(1)) if m else None
    return APIError(400, msg, name if name in _FIELDS else None)


class ErrorJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error message that quotes client input (even a lone surrogate) always
    encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return ErrorJSON(P.error_body(status, message, param), status_code=status)


def error_event(status: int, message: str) -> str:
    """An error as one server-sent event (a stream that cannot finish ends with it, then [DONE])."""
    return f"data: {json.dumps(P.error_body(status, message))}\n\n"


def _validation_message(e: RequestValidationError) -> JSONResponse:
    parts, param = [], None
    for err in e.errors()[:3]:
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", err.get("msg"))
            return error_response(400, f"Invalid JSON body: {detail}")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # a whole-request check (protocol.FieldError) names its field itself
        param = param or (loc[0] if loc else getattr(err.get("ctx", {}).get("error"), "field", None))
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return error_response(400, "; ".join(parts) or "invalid request", param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception to an OpenAI error JSON; only a bug (500) is logged with its traceback."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return _validation_message(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return error_response(404, f"Route {request.method} {request.url.path} not found")
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, e: ClientGone):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"Internal server error: {e!r}")
