"""The optional API key (`--api-key` / VERISPEC_API_KEY): `Authorization: Bearer KEY` on the /v1 routes."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request

from verispec.server.errors import APIError


def api_key_checker(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that answers 401 unless the request carries the key (compared in constant time)."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "Invalid or missing API key: pass it as 'Authorization: Bearer <key>'.")

    return check
