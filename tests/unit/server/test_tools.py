"""OpenAI tool calling (verispec/server/tools.py): tools / tool_choice validation, the constraints of "required"
and named choices, the hermes parser whole and streamed, and the response of each tool_choice."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.tiny_models import QWEN_TOOL_TEMPLATE, build_tokenizer
from verispec.server import tools as T
from verispec.server.protocol import ChatCompletionRequest, FieldError
from verispec.server.serving_chat import chat_prompt
from verispec.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


def _calls(calls):
    """Tool calls without their random ids."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---------------------------------------------------------------------------------------------- validation


def test_tool_choice_defaults_as_vllm():
    assert T.resolve_choice(None, None).mode == "none"
    assert T.resolve_choice([], None).mode == "none"
    assert T.resolve_choice(TOOLS, None).mode == "auto"
    assert T.resolve_choice(TOOLS, "none").mode == "none"
    assert T.resolve_choice(TOOLS, "required").mode == "required"
    named = T.resolve_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.name, named.tools) == ("named", "get_time", TOOLS)


BAD_TOOLS = [
    ("nope", "tools must be a list"),
    ([WEATHER, {"type": "retrieval"}], "tools[1] must be an object with type 'function'"),
    ([WEATHER, {"type": "function"}], "tools[1].function must be an object"),
    ([WEATHER, {"type": "function", "function": {"name": ""}}], "tools[1].function.name must be a non-empty"),
    ([WEATHER, {"type": "function", "function": {"name": 3}}], "tools[1].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name 'get_weather' names another tool"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 1}}], "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict"),
]


@pytest.mark.parametrize("tools,message", BAD_TOOLS)
def test_bad_tools_name_the_entry(tools, message):
    with pytest.raises(T.ToolError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        T.resolve_choice(tools, None)
    assert e.value.field == "tools"


BAD_CHOICES = [
    (TOOLS, "any", 'tool_choice must be "none", "auto", "required"'),
    (TOOLS, {"type": "function"}, "tool_choice must be"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
    (TOOLS, {"type": "other", "function": {"name": "get_time"}}, "tool_choice must be"),
    (None, "required", 'tool_choice "required" needs tools'),
    (None, {"type": "function", "function": {"name": "get_time"}}, "not among the tools"),
]


@pytest.mark.parametrize("tools,choice,message", BAD_CHOICES)
def test_bad_tool_choice_names_it(tools, choice, message):
    with pytest.raises(T.ToolError, match=message) as e:
        T.resolve_choice(tools, choice)
    assert e.value.field == "tool_choice"


def test_auto_needs_the_parser():
    auto = T.resolve_choice(TOOLS, None)
    with pytest.raises(T.ToolError, match="requires --enable-auto-tool-choice and --tool-call-parser") as e:
        T.check_auto(auto, None)
    assert str(e.value) == T.AUTO_TOOL_CHOICE_ERROR and e.value.field == "tool_choice"
    T.check_auto(auto, "hermes")
    # "none" and the constrained choices need no parser
    for choice in ("none", "required", {"type": "function", "function": {"name": "get_time"}}):
        T.check_auto(T.resolve_choice(TOOLS, choice), None)


# ---------------------------------------------------------------------------------------------- constraints


def test_named_constraint_is_the_functions_parameters():
    so = T.constraint(T.resolve_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}}))
    assert so.json == WEATHER["function"]["parameters"] and so.disable_any_whitespace
    so = T.constraint(T.resolve_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}}))
    assert so.json == {"type": "object"}
    assert T.constraint(T.resolve_choice(TOOLS, "auto")) is None
    assert T.constraint(T.resolve_choice(TOOLS, "none")) is None


def test_required_schema_pairs_each_name_with_its_parameters():
    so = T.constraint(T.resolve_choice(TOOLS, "required"))
    schema = so.json
    assert so.disable_any_whitespace
    assert schema["type"] == "array" and schema["minItems"] == 1
    items = schema["items"]["anyOf"]
    assert [i["properties"]["name"] for i in items] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert items[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert items[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert all(i["required"] == ["name", "parameters"] for i in items)


def test_required_schema_lifts_defs():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": point}}
    tools = [{"type": "function", "function": {"name": "move", "parameters": params}}, TIME]
    schema = T.required_schema(tools)
    assert schema["$defs"] == {"Point": point}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    # the request's own schema is left as it was
    assert params["$defs"] == {"Point": point}
    other = {
        "type": "function",
        "function": {"name": "b", "parameters": {"$defs": {"Point": {"type": "string"}}}},
    }
    with pytest.raises(T.ToolError, match=r"tools\[1\]\.function\.parameters: \$defs 'Point'"):
        T.required_schema([tools[0], other])


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_the_request_carries_the_tool_constraint():
    req = _chat(tools=TOOLS, tool_choice="required")
    sp = req.sampling_params(10, None)
    assert sp.structured_outputs.json["type"] == "array" and req.constraint_field() == "tools"
    named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.sampling_params(10, None).structured_outputs.json == WEATHER["function"]["parameters"]
    assert _chat(tools=TOOLS).sampling_params(10, None).structured_outputs is None
    assert _chat(tools=TOOLS).constraint_field() is None


@pytest.mark.parametrize(
    "other",
    [{"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a+"}}],
    ids=["response_format", "structured_outputs"],
)
def test_a_tool_constraint_with_another_is_refused(other):
    req = _chat(tools=TOOLS, tool_choice="required", **other)
    with pytest.raises(FieldError, match="cannot be combined with") as e:
        req.sampling_params(10, None)
    assert e.value.field == "tool_choice"
    # "auto" and "none" leave the output free: the other constraint applies
    for choice in ("auto", "none"):
        assert _chat(tools=TOOLS, tool_choice=choice, **other).sampling_params(10, None).structured_outputs


def test_tool_flow_messages_reach_the_template():
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    req = _chat(tools=TOOLS)
    req = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        ],
        tools=TOOLS,
    )
    msgs = [m.template_dict() for m in req.messages]
    assert msgs[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**call, "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}],
    }
    assert msgs[2] == {"role": "tool", "content": "12:00", "tool_call_id": "c1"}
    # the request's own message is left as it was
    assert req.messages[1].tool_calls[0]["function"]["arguments"] == '{"tz": "UTC"}'
    with pytest.raises(ValueError, match=r"tool_calls\[0\]"):
        ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": [{"function": {}}]}])


# ---------------------------------------------------------------------------------------------- hermes


def block(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


HERMES = [
    ("just text", "just text", []),
    ("", None, []),
    (block("get_time", {}), None, [("get_time", {})]),
    (
        block("get_weather", {"city": "Paris"}) + "\n" + block("get_time", {"tz": "CET"}),
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    (
        "Let me check.\n" + block("get_weather", {"city": "Oslo"}) + "\nDone.",
        "Let me check.\n\nDone.",
        [("get_weather", {"city": "Oslo"})],
    ),
    # malformed JSON: the block stays as content
    ("a <tool_call>\n{not json}\n</tool_call> b", "a <tool_call>\n{not json}\n</tool_call> b", []),
    (
        block("get_time", {}) + "<tool_call>{}</tool_call>",
        "<tool_call>{}</tool_call>",
        [("get_time", {})],
    ),
    # an unclosed block at the end: a call if its JSON is one
    ("x <tool_call>\n" + json.dumps({"name": "get_time", "arguments": {}}), "x", [("get_time", {})]),
    ("x <tool_call>\n{cut", "x <tool_call>\n{cut", []),
    # almost a tag
    ("a <tool_ca b <", "a <tool_ca b <", []),
    ("  \n padded \n ", "padded", []),
    # non-ASCII arguments
    (block("get_weather", {"city": "Zürich 東京"}), None, [("get_weather", {"city": "Zürich 東京"})]),
]


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes_parse(text, content, calls):
    got_content, got_calls = T.parse_hermes(text)
    assert got_content == content and _calls(got_calls) == calls
    for c in got_calls:
        assert c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") and len(c["id"]) > 20
    assert len({c["id"] for c in got_calls}) == len(got_calls)


def test_hermes_arguments_as_text():
    body = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert _calls(T.parse_hermes(body)[1]) == [("f", {"a": 1})]


def _stream(pieces: list[str]) -> tuple[str | None, list]:
    s = T.HermesStream()
    content, calls = [], []
    for p in pieces:
        c, k = s.feed(p)
        content.append(c)
        calls += k
    c, k = s.finish()
    return "".join(content + [c]) or None, calls + k


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes_stream_equals_the_whole_parse_at_every_split(text, content, calls):
    """Split in two at every character, in three at every pair of characters, and one character at a time."""
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    n = len(text)
    splits += [[text[:i], text[i:j], text[j:]] for i in range(0, n + 1, 3) for j in range(i, n + 1, 2)]
    splits.append(list(text))
    for pieces in splits:
        got_content, got_calls = _stream(pieces)
        assert (got_content, _calls(got_calls)) == (content, calls), pieces


def test_hermes_stream_holds_back_only_what_may_be_a_tag():
    s = T.HermesStream()
    assert s.feed("Hello <tool") == ("Hello", [])
    assert s.feed("box> and ") == (" <toolbox> and", [])
    content, calls = s.feed(block("get_time", {}) + " after")
    # the held space, then the text after the call
    assert content == "  after" and _calls(calls) == [("get_time", {})]


# ---------------------------------------------------------------------------------------------- responses


def test_final_messages():
    auto = T.resolve_choice(TOOLS, "auto")
    content, calls, reason = T.final_message(auto, "Sure. " + block("get_time", {}), "stop")
    assert (content, _calls(calls), reason) == ("Sure.", [("get_time", {})], "tool_calls")
    assert T.final_message(auto, "no call", "length") == ("no call", [], "length")
    required = T.resolve_choice(TOOLS, "required")
    text = json.dumps(
        [{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]
    )
    content, calls, reason = T.final_message(required, text, "stop")
    assert content is None and reason == "tool_calls"
    assert _calls(calls) == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    # cut by max_tokens: no calls, the text as content
    assert T.final_message(required, text[:20], "length") == (text[:20], [], "length")
    named = T.resolve_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    content, calls, reason = T.final_message(named, '{"city":"Lima"}', "stop")
    assert (content, _calls(calls), reason) == (None, [("get_weather", {"city": "Lima"})], "stop")
    assert T.final_message(T.resolve_choice(TOOLS, "none"), " raw ", "stop") == (" raw ", [], "stop")


def _accumulate(stream: T.ToolStream, pieces: list[str]):
    """What the openai client does with the deltas: content joined, tool calls merged by index."""
    content, calls, reason = [], {}, None
    for k, p in enumerate(pieces):
        last = k == len(pieces) - 1
        c, deltas = stream.feed(p, last)
        content.append(c or "")
        for d in deltas or []:
            slot = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            slot["name"] += d.get("function", {}).get("name") or ""
            slot["arguments"] += d.get("function", {}).get("arguments") or ""
            if "id" in d:
                assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function"
        reason = stream.finish_reason("stop") if last else None
    return (
        "".join(content) or None,
        [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)],
        reason,
    )


def test_tool_streams():
    named = T.resolve_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    got = _accumulate(T.ToolStream(named), ['{"ci', 'ty":', "", '"Lima"}', ""])
    assert got == (None, [("get_weather", '{"city":"Lima"}')], "stop")
    required = T.resolve_choice(TOOLS, "required")
    text = json.dumps(
        [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "X"}}]
    )
    content, calls, reason = _accumulate(T.ToolStream(required), [text[:7], text[7:30], text[30:]])
    assert content is None and reason == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_time", {}), ("get_weather", {"city": "X"})]
    assert _accumulate(T.ToolStream(required), ["[{", '"na'])[:2] == ('[{"na', [])
    auto = T.resolve_choice(TOOLS, "auto")
    text = "Let me see. " + block("get_time", {}) + block("get_weather", {"city": "Y"})
    content, calls, reason = _accumulate(
        T.ToolStream(auto), [text[i : i + 5] for i in range(0, len(text), 5)]
    )
    assert content == "Let me see." and reason == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_time", {}), ("get_weather", {"city": "Y"})]
    assert _accumulate(T.ToolStream(auto), ["plain ", "answer"]) == ("plain answer", [], "stop")
    none = T.resolve_choice(TOOLS, "none")
    assert _accumulate(T.ToolStream(none), [" a", block("get_time", {})])[:2] == (
        " a" + block("get_time", {}),
        [],
    )


def test_chat_prompt_renders_tools_and_the_tool_flow(tmp_path):
    """serving_chat.chat_prompt gives the template the tools and the tool flow's messages (Qwen2.5's template:
    the call's JSON-text arguments rendered as an object, the tool's answer as <tool_response>)."""
    build_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    tokenizer.chat_template = QWEN_TOOL_TEMPLATE
    ctx = SimpleNamespace(tokenizer=tokenizer, check_text_length=lambda n, param: None)
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    for choice in ("auto", "none"):
        req = ChatCompletionRequest(messages=messages, tools=TOOLS, tool_choice=choice)
        text, ids = chat_prompt(ctx, req, req.tool_plan())
        assert json.dumps(WEATHER) in text and json.dumps(TIME) in text
        assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>' in text
        assert "<tool_response>\n12:00\n</tool_response>" in text
        assert ids == tokenizer.encode(text, add_special_tokens=False)
    req = ChatCompletionRequest(messages=messages[:1])
    assert "<tools>" not in chat_prompt(ctx, req, req.tool_plan())[0]
