"""The optional API key (`--api-key` / VERISPEC_API_KEY): `Authorization: Bearer KEY` on every /v1 path, checked
by the front door (verispec/server/guard.py) before the route is looked up or the body read, so that a client
without the key learns nothing (not whether its JSON parses, nor which routes exist)."""

from __future__ import annotations

import hmac

from starlette.types import Scope

UNAUTHORIZED = "Invalid or missing API key: pass it as 'Authorization: Bearer <key>'."


def needs_key(path: str) -> bool:
    """The OpenAI API (/v1 and below); /health, /version and /metrics stay open, as in vLLM."""
    return path == "/v1" or path.startswith("/v1/")


def authorized(scope: Scope, api_key: str) -> bool:
    """Whether the request carries the key (compared in constant time)."""
    auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
    token = auth[7:] if auth[:7].lower() == b"bearer " else b""
    return hmac.compare_digest(token, api_key.encode())
