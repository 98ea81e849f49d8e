"""Errors in OpenAI's JSON shape (verispec/server/errors.py), over plain HTTP and through the openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import API_KEY

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


@pytest.mark.parametrize("path,body,status,needle", ERROR_CASES)
def test_error_cases(plain, path, body, status, needle):
    r = httpx.post(
        f"{plain.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert needle in err["message"]


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
