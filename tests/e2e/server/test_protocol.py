"""Request validation (verispec/server/protocol.py): fields that would change the output are a 400 naming them unless
neutral, and hostile input (lone surrogates, unknown roles) is a 400 naming the field, never a traceback."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import API_KEY

# hostile input: (path, body, message part, the param the error names)
HOSTILE = [
    ("/v1/completions", {"model": "tiny", "prompt": "a\ud800b"}, "lone UTF-16 surrogate", "prompt"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": ["ok", "\udfff"]},
        "prompt[1] is not valid Unicode",
        "prompt",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}},
        "stream_options can only be set when stream is true",
        "stream_options",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "hacker", "content": "hi"}]},
        "unknown role 'hacker'",
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
        "content[0]['text'] is not valid Unicode",
        "messages",
    ),
]


MSG = [{"role": "user", "content": "hi"}]


# fields that would change the output: a 400 naming them, never silently ignored
UNSUPPORTED = [
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": MSG, "response_format": {"type": "json_object"}},
        "response_format",
    ),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": MSG, "bad_words": "x"}, "bad_words"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages",
    ),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
]


@pytest.mark.parametrize("path,body,field", UNSUPPORTED)
def test_unsupported_fields_are_400_naming_them(plain, path, body, field):
    r = httpx.post(
        f"{plain.url}{path}",
        json={"model": "tiny", "max_tokens": 2, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_neutral_values_of_unsupported_fields_are_accepted(plain):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "logit_bias": {}, "best_of": 1, "tools": None}
    body |= {"response_format": {"type": "text"}}
    r = httpx.post(f"{plain.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text


def test_hostile_input_names_the_field_without_traceback(plain):
    """Lone surrogates (escaped or as raw UTF-8 bytes), stream_options without stream, an unknown chat role: a
    400 naming the field, and no traceback in the server log."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for path, body, needle, param in HOSTILE:
        r = httpx.post(f"{plain.url}{path}", content=json.dumps(body), headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert needle in r.json()["error"]["message"]
    raw = [
        ("/v1/completions", b'{"model": "tiny", "prompt": "x\xed\xa0\x80y"}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xb0\x80"}]}', "messages"),
    ]
    for path, body, param in raw:
        r = httpx.post(f"{plain.url}{path}", content=body, headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "surrogate" in r.json()["error"]["message"]
    # invalid UTF-8 (not a surrogate): still a 400, never a 500
    r = httpx.post(f"{plain.url}/v1/completions", content=b'{"prompt": "\xff"}', headers=headers, timeout=30)
    assert r.status_code == 400
    assert "Traceback" not in plain.log.read_text()
