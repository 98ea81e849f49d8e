"""The API key (verispec/server/auth.py, checked in verispec/server/guard.py): every /v1 request is authenticated
before its body is read or its route looked up, and the API docs are not served."""

from __future__ import annotations

import httpx

from tests.helpers import API_KEY


def test_the_key_is_checked_before_the_body_and_the_route(plain):
    json_type = {"Content-Type": "application/json"}
    keyed = {"Authorization": f"Bearer {API_KEY}", **json_type}
    for headers in (json_type, {"Authorization": "Bearer wrong", **json_type}):
        r = httpx.post(f"{plain.url}/v1/completions", content=b"{not json", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401, r.text
        assert httpx.get(f"{plain.url}/v1/no-such-route", headers=headers).status_code == 401
        assert httpx.post(f"{plain.url}/v1", headers=headers).status_code == 401
    # with the key, the same requests get their own answers
    r = httpx.post(f"{plain.url}/v1/completions", content=b"{not json", headers=keyed)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.get(f"{plain.url}/v1/no-such-route", headers=keyed).status_code == 404


def test_api_docs_are_off(plain, spec):
    """/docs, /redoc and /openapi.json describe every route and field: not served, with a key or without."""
    for srv in (plain, spec):
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            r = httpx.get(f"{srv.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"})
            assert r.status_code == 404, (path, r.text[:200])
