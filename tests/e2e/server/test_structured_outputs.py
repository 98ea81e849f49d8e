"""Structured outputs through `verispec serve` (verispec/server/protocol.py, serving.py): OpenAI's response_format
(json_schema, json_object) and vLLM's structured_outputs (json, regex, choice, grammar) on both endpoints, streamed,
with n > 1 and under speculation; a bad constraint is a 400 naming its field, after which the server still serves.

The tiny model is random: left free it spends a JSON output on whitespace and never closes it within max_tokens.
OpenAI's response_format has no whitespace option, so those requests bias the whitespace-only tokens away
(logit_bias), as a trained model would leave them; structured_outputs requests set disable_any_whitespace."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.helpers import API_KEY

MSG = [{"role": "user", "content": "Describe a person as JSON."}]
COLORS = ["red", "green", "blue"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": COLORS},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True, "description": "a person"},
}
COMPACT = {"json": SCHEMA, "disable_any_whitespace": True}


@pytest.fixture(scope="module")
def no_whitespace(ckpt) -> dict[str, int]:
    """logit_bias pushing away the tokens that are only whitespace (byte-level BPE: Ġ, ĉ, Ċ, č and their runs)."""
    vocab = Tokenizer.from_file(str(Path(ckpt) / "tokenizer.json")).get_vocab()
    ids = [i for tok, i in vocab.items() if tok and all(c in "ĠĉĊč" for c in tok)]
    assert len(ids) >= 4
    return {str(i): -100 for i in ids}


def check_person(text: str) -> None:
    """The output parses and follows SCHEMA (checked by hand)."""
    obj = json.loads(text)
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "color"}, text
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 99
    assert obj["color"] in COLORS


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{srv.url}{path}",
        json={"model": "tiny", **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )


def test_response_format_json_schema_chat_and_completions(plain, no_whitespace):
    client = plain.client()
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny",
            messages=MSG,
            response_format=RESPONSE_FORMAT,
            max_tokens=60,
            seed=seed,
            logit_bias=no_whitespace,
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        check_person(r.choices[0].message.content)
    # vLLM takes response_format on /v1/completions too
    r = client.completions.create(
        model="tiny",
        prompt="A person:",
        max_tokens=60,
        seed=0,
        logit_bias=no_whitespace,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    check_person(r.choices[0].text)


def test_response_format_json_object(plain, no_whitespace):
    client = plain.client()
    finished = 0
    for seed in range(4):
        r = client.chat.completions.create(
            model="tiny",
            messages=MSG,
            response_format={"type": "json_object"},
            max_tokens=60,
            seed=seed,
            logit_bias=no_whitespace,
        )
        c = r.choices[0]
        # any object: its strings are unbounded, so a random model may still be inside one at max_tokens
        assert c.message.content.startswith("{"), c.message.content
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
            finished += 1
    assert finished
    # {"type": "text"} constrains nothing
    r = client.chat.completions.create(
        model="tiny", messages=MSG, response_format={"type": "text"}, max_tokens=4, temperature=0
    )
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize(
    "constraint,check",
    [
        ({"choice": ["yes", "no", "maybe later"]}, lambda t: t in ("yes", "no", "maybe later")),
        ({"regex": r"[a-z]{3}-[0-9]{2,4}"}, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", t)),
        ({"grammar": 'start: "(" NUM ("," NUM)~0..2 ")"\nNUM: /[0-9]{1,3}/'}, None),
        ({"grammar": 'root ::= "x" [a-c] [a-c]? "!"'}, lambda t: re.fullmatch(r"x[a-c]{1,2}!", t)),
    ],
)
def test_structured_outputs_on_completions(plain, constraint, check):
    client = plain.client()
    for seed in range(3):
        r = client.completions.create(
            model="tiny",
            prompt="Answer:",
            max_tokens=40,
            seed=seed,
            extra_body={"structured_outputs": constraint},
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c.text
        if check is None:
            assert re.fullmatch(r"\(\d{1,3}(,\d{1,3}){0,2}\)", c.text), c.text
        else:
            assert check(c.text), c.text


def test_structured_outputs_json_on_chat_and_under_speculation(servers):
    for which in ("plain", "spec"):
        client = servers[which].client()
        for seed in range(2):
            r = client.chat.completions.create(
                model="tiny",
                messages=MSG,
                max_tokens=60,
                seed=seed,
                extra_body={"structured_outputs": COMPACT},
            )
            assert r.choices[0].finish_reason == "stop"
            check_person(r.choices[0].message.content)
        # the schema as JSON text, as vLLM takes it
        r = client.completions.create(
            model="tiny",
            prompt="The quick brown fox",
            max_tokens=60,
            temperature=0,
            extra_body={"structured_outputs": COMPACT | {"json": json.dumps(SCHEMA)}},
        )
        check_person(r.choices[0].text)


def test_streaming_with_a_schema(plain, no_whitespace):
    client = plain.client()
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MSG,
            response_format=RESPONSE_FORMAT,
            max_tokens=60,
            seed=1,
            logit_bias=no_whitespace,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    check_person(text)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="A person:",
            max_tokens=60,
            seed=2,
            stream=True,
            extra_body={"structured_outputs": COMPACT},
        )
    )
    check_person("".join(c.choices[0].text for c in chunks if c.choices))


def test_n_and_batches_each_follow_the_schema(plain, no_whitespace):
    """Every engine request of a fan-out (n, a batch of prompts) gets its own grammar state."""
    client = plain.client()
    r = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        response_format=RESPONSE_FORMAT,
        max_tokens=60,
        n=2,
        seed=3,
        logit_bias=no_whitespace,
    )
    assert len(r.choices) == 2
    for c in r.choices:
        check_person(c.message.content)
    r = client.completions.create(
        model="tiny",
        prompt=["A person:", "Another one:"],
        n=2,
        max_tokens=60,
        seed=4,
        extra_body={"structured_outputs": COMPACT},
    )
    assert len(r.choices) == 4
    for c in r.choices:
        check_person(c.text)


CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
# (path, request fields, the param the 400 names, a part of its message)
BAD = [
    (CMPL, {"structured_outputs": {"json": "{not json"}}, "structured_outputs", "structured_outputs.json"),
    (CMPL, {"structured_outputs": {"regex": "(["}}, "structured_outputs", "structured_outputs.regex"),
    (
        CMPL,
        {"structured_outputs": {"grammar": "start: ("}},
        "structured_outputs",
        "structured_outputs.grammar",
    ),
    (CHAT, {"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown keys ['jsn']"),
    (CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "regex, choice"),
    (CHAT, {"structured_outputs": {}}, "structured_outputs", "none are specified"),
    (CHAT, {"structured_outputs": {"choice": []}}, "structured_outputs", "structured_outputs.choice"),
    (
        CHAT,
        {"structured_outputs": {"structural_tag": "{}"}},
        "structured_outputs",
        "structural_tag.structures",
    ),
    (
        CHAT,
        {
            "structured_outputs": {
                "structural_tag": {"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<g"]}
            }
        },
        "structured_outputs",
        "starts with none of the triggers",
    ),
    (CHAT, {"structured_outputs": "json"}, "structured_outputs", "structured_outputs"),
    (CHAT, {"response_format": {"type": "foo"}}, "response_format", "'json_schema'"),
    (CHAT, {"response_format": {"type": "structural_tag"}}, "response_format", "response_format.structures"),
    (CHAT, {"response_format": {}}, "response_format", "response_format.type"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema"),
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        "response_format.json_schema.schema",
    ),
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format",
        "response_format.json_schema.name",
    ),
    (
        CMPL,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format",
        "response_format.json_schema.schema",
    ),
    (
        CHAT,
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "response_format",
        "only one",
    ),
    (CHAT, {"guided_json": SCHEMA}, "guided_json", '{"structured_outputs": {"json": ...}}'),
    (CMPL, {"guided_regex": "a+"}, "guided_regex", '{"structured_outputs": {"regex": ...}}'),
    (CMPL, {"guided_choice": ["a", "b"]}, "guided_choice", "structured_outputs"),
    (CMPL, {"guided_grammar": "start: 'a'"}, "guided_grammar", "structured_outputs"),
]


def test_bad_constraints_are_400_naming_the_field(plain):
    """Each is a 400 in OpenAI's error JSON naming the field (never a 500, never a traceback), through the openai
    client too, and the server serves a good request afterwards."""
    for path, fields, param, needle in BAD:
        body = {"prompt": "hi"} if path == CMPL else {"messages": MSG}
        r = post(plain, path, {**body, "max_tokens": 4, **fields})
        assert r.status_code == 400, (fields, r.text)
        err = r.json()["error"]
        assert err["param"] == param and needle in err["message"], (fields, err)
        assert err["type"] == "BadRequestError" and err["code"] == 400
    with pytest.raises(openai.BadRequestError) as e:
        plain.client().chat.completions.create(
            model="tiny",
            messages=MSG,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        )
    assert e.value.body["param"] == "response_format"
    assert "Traceback" not in plain.log.read_text()
    r = post(plain, CMPL, {"prompt": "hi", "max_tokens": 20, "structured_outputs": {"choice": ["on", "off"]}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("on", "off")
    assert httpx.get(f"{plain.url}/health", timeout=10).status_code == 200


def test_grammars_compile_off_the_engine_thread_one_per_engine_request(ckpt):
    """In-process: the worker thread that builds the engine requests compiles each one's own matcher (n=2: two),
    the engine thread only adds them; a constraint that does not compile is an APIError naming the field, and the
    engine thread keeps serving."""
    from verispec import LLM
    from verispec.server import protocol as P
    from verispec.server.async_engine import AsyncEngine
    from verispec.server.errors import APIError
    from verispec.server.serving import ServingContext

    local = LLM(ckpt, max_model_len=128, max_num_seqs=2)
    threads, added = [], []
    real_compile, real_add = local.engine.grammar_for, local.engine.add_request

    def grammar_for(params):
        threads.append(threading.current_thread().name)
        return real_compile(params)

    def add_request(*args, **kw):
        added.append(kw.get("grammar"))
        return real_add(*args, **kw)

    local.engine.grammar_for, local.engine.add_request = grammar_for, add_request

    async def main():
        ae = AsyncEngine(local, None, max_queue=4)
        ctx = ServingContext(ae, local.tokenizer, ["tiny"], 128, max_children=8)
        ae.start()
        try:
            bad = P.CompletionRequest(prompt="hi", structured_outputs={"regex": "(["}, max_tokens=4)
            with pytest.raises(APIError) as e:
                await asyncio.to_thread(ctx.engine_requests, "bad", [("hi", [5, 6])], bad, 4, None)
            assert e.value.status == 400 and e.value.param == "structured_outputs"
            req = P.CompletionRequest(prompt="hi", n=2, seed=0, structured_outputs={"choice": ["ab", "cd"]})
            reqs = await asyncio.to_thread(ctx.engine_requests, "ok", [("hi", [5, 6])], req, 20, None)
            assert len(reqs) == 2 and reqs[0].grammar is not None and reqs[0].grammar is not reqs[1].grammar
            outs = {}
            async for i, out in await ctx.submit(reqs):
                outs[i] = out.outputs[0].text
            assert sorted(outs) == [0, 1] and set(outs.values()) <= {"ab", "cd"}
        finally:
            ae.shutdown()

    asyncio.run(main())
    assert len(threads) == 3 and "verispec-engine" not in threads
    assert len(added) == 2 and all(g is not None for g in added)


def test_response_format_structural_tag(plain):
    """vLLM's structural tag through OpenAI's response_format: free text with tagged tool segments (a random model
    rarely opens one; the segments' constraint is tested in tests/unit/sample/test_grammar.py)."""
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<function=f>", "schema": {"type": "object"}, "end": "</function>"}],
        "triggers": ["<function="],
    }
    r = plain.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], response_format=tag, max_tokens=8
    )
    assert r.choices[0].message.content is not None
