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
        {"messages": MSG, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "response_format",
    ),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "foo"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {}}, "guided_json"),
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


# wrong JSON types: OpenAI answers 400 (a bool is not an integer, a string not a number); non-finite or
# out-of-vocabulary values too
WRONG_TYPES = [
    ("/v1/completions", {"max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"top_p": "0.9"}, "top_p"),
    ("/v1/completions", {"n": "2"}, "n"),
    ("/v1/completions", {"n": True}, "n"),
    ("/v1/completions", {"seed": "5"}, "seed"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"echo": 1}, "echo"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
    ("/v1/completions", {"logit_bias": {"100": float("nan")}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"100": float("inf")}}, "logit_bias"),
    ("/v1/chat/completions", {"stop_token_ids": [99999999]}, "stop_token_ids"),
]


@pytest.mark.parametrize("path,body,field", WRONG_TYPES)
def test_wrong_types_are_400_naming_the_field(plain, path, body, field):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MSG}
    # json.dumps writes NaN and Infinity, as a careless client would
    content = json.dumps({"model": "tiny", "max_tokens": 2, **base, **body})
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{plain.url}{path}", content=content, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"], r.text


def test_integers_are_numbers(plain):
    """An integer where a number is expected is fine (OpenAI and JSON agree)."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 1, "top_p": 1}
    body |= {"logit_bias": {"5": 2}, "presence_penalty": 0}
    r = httpx.post(f"{plain.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text


# each list field's limit (protocol.LIST_LIMITS) plus one
TOO_LONG = [
    ("stop", [f"s{i}" for i in range(1025)], 1024),
    ("bad_words", [f"w{i}" for i in range(1025)], 1024),
    ("stop_token_ids", [5] * 1025, 1024),
    ("logit_bias", {str(i): 1 for i in range(1025)}, 1024),
    ("allowed_token_ids", [5] * ((1 << 18) + 1), 1 << 18),
]


@pytest.mark.parametrize("field,value,limit", TOO_LONG, ids=[t[0] for t in TOO_LONG])
def test_list_fields_have_limits(plain, field, value, limit):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value}
    r = httpx.post(
        f"{plain.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"at most {limit}" in err["message"], err


def test_prompt_batches_over_the_limit_are_refused_before_tokenizing(plain):
    body = {"model": "tiny", "prompt": ["hi"] * 5000, "max_tokens": 2}
    r = httpx.post(
        f"{plain.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_lone_surrogates_in_unknown_fields_are_400(plain):
    """The docs promise: a lone surrogate anywhere in a request is a 400, unknown fields and keys included."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    cases = [
        ("/v1/completions", {"prompt": "hi", "my_field": "a\ud800"}, "my_field"),
        ("/v1/completions", {"prompt": "hi", "my_field": {"deep": ["\udfff"]}}, "my_field"),
        ("/v1/completions", {"prompt": "hi", "\ud800": 1}, None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "x": "\ud800"}]},
            "messages",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stream": True, "stream_options": {"x": "\ud800"}},
            "stream_options",
        ),
    ]
    for path, body, param in cases:
        r = httpx.post(f"{plain.url}{path}", content=json.dumps({"model": "tiny", **body}), headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert "surrogate" in r.json()["error"]["message"]
    raw = b'{"model": "tiny", "prompt": "hi", "other": "\xed\xa0\x80"}'
    r = httpx.post(f"{plain.url}/v1/completions", content=raw, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "other", r.text
