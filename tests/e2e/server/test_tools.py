"""Tool calling in /v1/chat/completions (verispec/server/tools.py) with the official `openai` client, on the tiny
random model: named and "required" tool choices give calls that follow the tools' schemas (streamed too), the
follow-up turn with the calls and their results is accepted, and "auto" needs --enable-auto-tool-choice and
--tool-call-parser (the random model never calls a tool by itself: the hermes parser is unit-tested)."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from tests.helpers import ROOT, Server
from tests.tiny_models import QWEN_TOOL_TEMPLATE, write_tiny_checkpoint

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["utc", "cet"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _follows_schema(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"unit", "days"} and args["unit"] in ("c", "f") and 1 <= args["days"] <= 5
    else:
        assert name == "get_time" and set(args) == {"tz"} and args["tz"] in ("utc", "cet")


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """The tiny model with Qwen2.5's tool template, served with the hermes parser for tool_choice "auto"."""
    d = tmp_path_factory.mktemp("tools")
    ckpt = write_tiny_checkpoint(d / "llama", "llama")
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "chat_template": QWEN_TOOL_TEMPLATE}))
    # the tools' JSON takes ~700 of the tiny tokenizer's tokens: room for them (RoPE takes any length)
    model_cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**model_cfg, "max_position_embeddings": 2048}))
    args = [str(ckpt), "--served-model-name", "tiny", "--max-model-len", "2048", "--max-num-seqs", "4"]
    server = Server([*args, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], d / "serve.log")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_named_tool_choice_calls_that_function(tool_server):
    client = tool_server.client()
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=80, seed=1
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    _follows_schema(call.function.name, call.function.arguments)


def test_required_then_the_follow_up_turn(tool_server):
    client = tool_server.client()
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) >= 1 and len({c.id for c in calls}) == len(calls)
    for call in calls:
        _follows_schema(call.function.name, call.function.arguments)
    # the openai flow: the assistant message as received, then each call's result
    messages = [*MESSAGES, choice.message]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls]
    follow = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert isinstance(follow.choices[0].message.content, str) and follow.choices[0].message.tool_calls is None
    # the calls and their results are in the prompt: longer than the first turn's by their text
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens + 10


def test_streamed_named_call_accumulates_to_valid_arguments(tool_server):
    stream = tool_server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=80, seed=2, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            slot["name"] += (d.function.name or "") if d.function else ""
            slot["arguments"] += (d.function.arguments or "") if d.function else ""
    assert list(calls) == [0] and calls[0]["id"].startswith("chatcmpl-tool-")
    assert calls[0]["name"] == "get_weather"
    _follows_schema("get_weather", calls[0]["arguments"])
    assert not any(c.choices[0].delta.content for c in chunks[1:])
    assert chunks[-1].choices[0].finish_reason == "stop"
    # the client's own accumulation (its streaming helper) gives the same call
    with tool_server.client().chat.completions.stream(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=80, seed=2
    ) as s:
        final = s.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", calls[0]["arguments"])


def test_streamed_required_calls(tool_server):
    stream = tool_server.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas and [d.index for d in deltas] == list(range(len(deltas)))
    for d in deltas:
        _follows_schema(d.function.name, d.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_with_the_parser_answers(tool_server):
    """tool_choice "auto" (the default with tools): the random model writes text, no call."""
    client = tool_server.client()
    for choice in ({}, {"tool_choice": "auto"}):
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, **choice
        )
        assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=3, stream=True
    )
    assert list(stream)[-1].choices[0].finish_reason in ("stop", "length")


def test_auto_without_the_flags_is_400(plain):
    client = plain.client()
    for choice in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4, **choice
            )
        err = e.value.body
        assert err["message"] == (
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
        assert err["param"] == "tool_choice"
    # "none", named and "required" need no parser
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert r.choices[0].message.tool_calls is None


BAD_SCHEMA = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
}
BAD_REQUESTS = [
    ({"tools": [BAD_SCHEMA], "tool_choice": "required"}, "tools", "the tools' parameters schema"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": ""}}]}, "tools", "tools[1].function.name"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "cannot be combined with response_format",
    ),
    (
        {"tools": TOOLS, "tool_choice": NAMED, "extra_body": {"structured_outputs": {"regex": "a+"}}},
        "tool_choice",
        "cannot be combined with structured_outputs",
    ),
]


@pytest.mark.parametrize("body,param,needle", BAD_REQUESTS)
def test_bad_tool_requests_are_400_naming_the_field(tool_server, body, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        tool_server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **body)
    assert e.value.body["param"] == param and needle in e.value.body["message"], e.value.body


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (one of hermes)"),
        (
            ["--enable-auto-tool-choice", "--tool-call-parser", "mistral"],
            "must be one of hermes, got 'mistral'",
        ),
        (["--tool-call-parser", "pythonic"], "must be one of hermes"),
    ],
)
def test_tool_flags_are_checked_before_loading(args, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "verispec.server.cli", "no-such-model", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
