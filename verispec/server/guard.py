"""The server's front door, ahead of routing and body parsing (a plain ASGI middleware).

It answers 401 to a /v1 request without the API key (verispec/server/auth.py), refuses a body over
`--max-request-body-bytes` with 413 before reading it (from Content-Length, or while a chunked body arrives),
refuses new /v1 requests with 503 while the server drains for shutdown, and counts the requests in progress so that
the shutdown can wait for their responses to be sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from verispec.server.auth import UNAUTHORIZED, authorized, needs_key
from verispec.server.errors import error_response


def too_large_message(limit: int) -> str:
    return f"Request body too large: at most {limit} bytes are accepted (--max-request-body-bytes)."


@dataclass
class Admission:
    """Shared between the guard, /health and the shutdown drain."""

    draining: bool = False
    # HTTP requests whose response is not finished yet
    active: int = 0


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, admission: Admission, api_key: str | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.admission = admission
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        keyed = needs_key(scope["path"])
        if keyed and self.api_key is not None and not authorized(scope, self.api_key):
            await error_response(401, UNAUTHORIZED)(scope, receive, send)
            return
        if self.admission.draining and keyed:
            msg = "The server is shutting down and accepts no new requests."
            await error_response(503, msg)(scope, receive, send)
            return
        limit = self.max_body_bytes
        length = _content_length(scope)
        if length is not None and length > limit:
            await error_response(413, too_large_message(limit))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI passes an HTTPException from the body read through to the error handlers
                    raise HTTPException(413, too_large_message(limit))
            return message

        self.admission.active += 1
        try:
            await self.app(scope, limited_receive, send)
        finally:
            self.admission.active -= 1


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
