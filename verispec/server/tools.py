"""OpenAI tool calling for /v1/chat/completions, as vLLM does it.

- `resolve_choice` validates a request's `tools` and `tool_choice` (ToolError naming the field: `tools[1].function.name`)
  and applies vLLM's default: "auto" when tools are given, "none" otherwise.
- `constraint`: what a "required" or named tool_choice makes the output follow (a JSON schema, compact JSON); "auto"
  and "none" leave the output free.
- `final_message` / `ToolStream`: the output text as the response's content and tool_calls, whole or streamed. With
  "auto" the text is read by the hermes parser (Qwen2.5 / Hermes 2 Pro: `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>` blocks); with "required" it is vLLM's JSON array of {"name", "parameters"}; with a named
  function it is that function's arguments.

The tools themselves are rendered into the prompt by the model's chat template (serving_chat.chat_prompt).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from verispec.sampling_params import StructuredOutputsParams

# --tool-call-parser values
TOOL_PARSERS = ("hermes",)
# vLLM's message for tool_choice "auto" on a server started without them
AUTO_TOOL_CHOICE_ERROR = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` (a 400); `field` names the request field at fault."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass
class ToolChoice:
    """A request's resolved tool_choice: mode "none", "auto", "required" or "named" (then `name`), and its
    validated tools."""

    mode: str
    tools: list[dict] = field(default_factory=list)
    name: str | None = None


def new_call(name: str, arguments: str) -> dict:
    """One OpenAI tool call (the response's message.tool_calls entry)."""
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


# ---------------------------------------------------------------------------------------------- validation


def validate_tools(tools: Any) -> list[dict]:
    """The request's `tools`: a list of {"type": "function", "function": {"name", "description"?, "parameters"?
    (a JSON schema object), "strict"?}}, names unique. ToolError naming the entry at fault."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {'type': 'function', 'function': {...}} objects", "tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f"{where} must be an object with type 'function'", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function must be an object with a name", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"{where}.function.name must be a non-empty string", "tools")
        if name in names:
            raise ToolError(f"{where}.function.name {name!r} names another tool too", "tools")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolError(f"{where}.function.description must be a string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object", "tools")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ToolError(f"{where}.function.strict must be true or false", "tools")
    return tools


def resolve_choice(tools: Any, tool_choice: Any) -> ToolChoice:
    """Validate `tools` and `tool_choice` ("none", "auto", "required" or {"type": "function", "function": {"name":
    X}} with X one of the tools); None means vLLM's default: "auto" with tools, "none" without."""
    valid = validate_tools(tools)
    if tool_choice is None:
        return ToolChoice("auto" if valid else "none", valid)
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not valid:
            raise ToolError(f'tool_choice "{tool_choice}" needs tools', "tool_choice")
        return ToolChoice(tool_choice, valid)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise ToolError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in valid}:
        raise ToolError(
            f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice"
        )
    return ToolChoice("named", valid, name)


def check_auto(choice: ToolChoice, parser: str | None) -> None:
    """tool_choice "auto" (with tools) needs the server's tool-call parser (--enable-auto-tool-choice and
    --tool-call-parser): ToolError with vLLM's message otherwise."""
    if choice.mode == "auto" and parser is None:
        raise ToolError(AUTO_TOOL_CHOICE_ERROR, "tool_choice")


# ---------------------------------------------------------------------------------------------- constraints


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_schema(tools: list[dict]) -> dict:
    """vLLM's schema for tool_choice "required" (`_get_json_schema_from_tool`): a non-empty array of {"name",
    "parameters"} objects, anyOf over the tools so that each name goes with its own parameters; the tools'
    `$defs` are lifted to the top (where their `#/$defs/...` references point). ToolError if two tools define the
    same `$defs` entry differently."""
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        params = dict(_parameters(tool))
        for k, v in (params.pop("$defs", None) or {}).items():
            if k in defs and defs[k] != v:
                raise ToolError(
                    f"tools[{i}].function.parameters: $defs {k!r} differs from another tool's", "tools"
                )
            defs[k] = v
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool["function"]["name"]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema


def constraint(choice: ToolChoice) -> StructuredOutputsParams | None:
    """What the output must follow: a named function's parameters (its arguments are the whole output), or the
    "required" array; compact JSON (no whitespace outside strings), as a model writes tool calls. None for "auto"
    and "none"."""
    if choice.mode == "named":
        tool = next(t for t in choice.tools if t["function"]["name"] == choice.name)
        schema = tool["function"].get("parameters") or {"type": "object"}
    elif choice.mode == "required":
        schema = required_schema(choice.tools)
    else:
        return None
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


# ---------------------------------------------------------------------------------------------- parsing


def _hermes_call(body: str) -> dict | None:
    """One `<tool_call>` block's JSON as a tool call, or None if it is not {"name": str, "arguments": ...}."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return new_call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """The hermes parser: (content, tool calls) of a whole output. Each `<tool_call>...</tool_call>` block (and an
    unclosed one at the very end) holding {"name": ..., "arguments": {...}} is a tool call; a block whose JSON is
    malformed stays in the content, tags and all (as vLLM leaves it). Content is the text outside the calls,
    stripped, None if empty."""
    content, calls, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _hermes_call(m.group(1) if m.group(1) is not None else m.group(2))
        if call is None:
            continue
        content.append(text[pos : m.start()])
        calls.append(call)
        pos = m.end()
    content.append(text[pos:])
    return "".join(content).strip() or None, calls


def parse_required(text: str) -> list[dict] | None:
    """The output of tool_choice "required" (a JSON array of {"name", "parameters"}) as tool calls (each one's
    arguments: its parameters as JSON text), or None if it is not such an array (e.g. cut by max_tokens)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    if not all(isinstance(x, dict) and isinstance(x.get("name"), str) for x in items):
        return None
    return [new_call(x["name"], json.dumps(x.get("parameters", {}), ensure_ascii=False)) for x in items]


def final_message(
    choice: ToolChoice, text: str, finish_reason: str | None
) -> tuple[str | None, list, str | None]:
    """A finished output as the response's (content, tool_calls, finish_reason), as vLLM answers: "auto" and
    "required" say finish_reason "tool_calls" when calls were made; a named function's call keeps the output's
    reason. Without calls the text is the content."""
    if choice.mode == "auto":
        content, calls = parse_hermes(text)
        return content, calls, "tool_calls" if calls else finish_reason
    if choice.mode == "required":
        calls = parse_required(text)
        return (None, calls, "tool_calls") if calls else (text, [], finish_reason)
    if choice.mode == "named":
        return None, [new_call(choice.name, text)], finish_reason
    return text, [], finish_reason


def _partial_start(text: str) -> int:
    """Where a suffix of `text` that could begin "<tool_call>" starts (len(text) if none)."""
    for k in range(min(len(CALL_START) - 1, len(text)), 0, -1):
        if CALL_START.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class HermesStream:
    """The hermes parser fed text deltas: each feed returns (content delta, tool calls completed by it) so that the
    content deltas add up to parse_hermes' content and the calls are its calls, however the text is split.

    Held back meanwhile: a suffix that could be the start of "<tool_call>", an open block until "</tool_call>"
    (or the end of the output: finish()), leading whitespace and whitespace that may turn out to be trailing. A
    call is returned whole when its block closes (name and complete arguments in one delta)."""

    def __init__(self):
        self.buf = ""
        self.in_block = False
        # content so far has non-whitespace; whitespace held back until more content follows
        self.started = False
        self.ws = ""

    def _content(self, text: str) -> str:
        """Content text out, leading whitespace dropped and trailing whitespace held."""
        body = text.rstrip()
        if not body:
            self.ws += text if self.started else ""
            return ""
        out = (self.ws if self.started else "") + (body if self.started else body.lstrip())
        self.started, self.ws = True, text[len(body) :]
        return out

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buf += delta
        out, calls = [], []
        while True:
            if self.in_block:
                end = self.buf.find(CALL_END)
                if end < 0:
                    break
                body, self.buf, self.in_block = self.buf[:end], self.buf[end + len(CALL_END) :], False
                call = _hermes_call(body)
                if call is None:
                    out.append(self._content(CALL_START + body + CALL_END))
                else:
                    calls.append(call)
                continue
            start = self.buf.find(CALL_START)
            if start < 0:
                keep = _partial_start(self.buf)
                out.append(self._content(self.buf[:keep]))
                self.buf = self.buf[keep:]
                break
            out.append(self._content(self.buf[:start]))
            self.buf, self.in_block = self.buf[start + len(CALL_START) :], True
        return "".join(out), calls

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the output: an unclosed block is a call if its JSON is one, else content; trailing
        whitespace is dropped."""
        rest, self.buf = self.buf, ""
        if not self.in_block:
            return self._content(rest), []
        self.in_block = False
        call = _hermes_call(rest)
        return ("", [call]) if call is not None else (self._content(CALL_START + rest), [])


class ToolStream:
    """One streamed choice's deltas under a tool_choice: feed(text delta, finished) -> (content delta or None, tool
    call deltas in OpenAI's streamed shape [{"index", "id", "type", "function": {"name", "arguments"}}] or None).

    "none": the text as it comes. "auto": the hermes parser (a call in one delta as its block closes). Named: the
    call's id and name with the first text, then its arguments as they are generated. "required": the calls all at
    once when the output is complete (the array is parsed whole), or the text as content if it is no such array."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.hermes = HermesStream() if choice.mode == "auto" else None
        self.text: list[str] = []
        self.calls = 0

    def _deltas(self, calls: list[dict]) -> list[dict] | None:
        out = [{"index": self.calls + k, **c} for k, c in enumerate(calls)]
        self.calls += len(calls)
        return out or None

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[dict] | None]:
        mode = self.choice.mode
        if mode == "none":
            return delta or None, None
        if mode == "auto":
            content, calls = self.hermes.feed(delta)
            if finished:
                more, late = self.hermes.finish()
                content, calls = content + more, calls + late
            return content or None, self._deltas(calls)
        if mode == "named":
            if not delta and (self.calls or not finished):
                return None, None
            if self.calls:
                return None, [{"index": 0, "function": {"arguments": delta}}]
            return None, self._deltas([new_call(self.choice.name, delta)])
        self.text.append(delta)
        if not finished:
            return None, None
        calls = parse_required("".join(self.text))
        return (None, self._deltas(calls)) if calls else ("".join(self.text) or None, None)

    def finish_reason(self, reason: str | None) -> str | None:
        """The finishing chunk's reason: "tool_calls" when "auto" or "required" made calls, as vLLM."""
        return "tool_calls" if self.calls and self.choice.mode in ("auto", "required") else reason
