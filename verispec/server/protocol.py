"""OpenAI request/response models for /v1/completions and /v1/chat/completions (vLLM's extra fields included).

Unknown request fields are ignored, as OpenAI and vLLM do; known ones this server does not implement
(best_of, suffix, ...) are a 400 naming the field unless left at their neutral value. Types
are strict (no "4" or true for an integer, only finite numbers), list fields have limits (LIST_LIMITS), and a lone
UTF-16 surrogate anywhere, unknown fields included, is a 400. Errors use OpenAI's nested shape
`{"error": {"message", "type", "param", "code"}}` so the `openai` client raises the right exception class.

Structured outputs come as vLLM's `structured_outputs` object (json, regex, choice, grammar, json_object, ...; both
endpoints) or OpenAI's `response_format` ({"type": "text"}: none; "json_object"; "json_schema" with
`json_schema.schema`), never both; a bad one is a 400 naming the field. vLLM 0.12 removed the `guided_*` fields:
each is a 400 naming its `structured_outputs` replacement. Chat `tools` / `tool_choice`: verispec/server/tools.py.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from verispec.sampling_params import SamplingParams, StructuredOutputsParams
from verispec.server import tools as T

# vLLM's default --max-logprobs
MAX_LOGPROBS = 20
# JSON types as OpenAI checks them: pydantic's lax mode would coerce "4" and true to 4 and 1, and "0.5" to 0.5; an
# integer is a number, and a number is finite (Python's JSON parser reads NaN and Infinity)
Number = Annotated[float, Strict(), AllowInfNan(False)]
# Most entries each list field may hold (a 400 above): every entry costs work at every step (stop strings, bad
# words) or when the request is added. allowed_token_ids may list a whole vocabulary (the largest we know: 262k).
LIST_LIMITS = {
    "stop": 1024,
    "stop_token_ids": 1024,
    "bad_words": 1024,
    "logit_bias": 1024,
    "allowed_token_ids": 1 << 18,
}


# the fields vLLM 0.12 removed -> their structured_outputs key
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def check_unicode(value: Any, path: str) -> None:
    """Raise ValueError naming `path` if a string in `value` holds a lone UTF-16 surrogate (JSON's "\\ud800", or
    the bytes of one): no tokenizer or response encoder can take it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{path} is not valid Unicode: lone UTF-16 surrogate {value[e.start]!r} at character {e.start}"
            ) from None
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if not isinstance(v, int):
                check_unicode(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k, f"{path} key")
            check_unicode(v, f"{path}[{k!r}]")


class FieldError(ValueError):
    """A ValueError naming the request field at fault (pydantic reports a whole-model error without one)."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields_valid_unicode(cls, data: Any) -> Any:
        """Unknown fields are ignored, but a lone surrogate in one (or in its name) is still a 400: the docs
        promise it for anywhere in a request."""
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            if key in cls.model_fields:
                continue
            try:
                check_unicode(key, "a field name")
            except ValueError as e:
                raise FieldError(str(e), None) from None
            try:
                check_unicode(value, key)
            except ValueError as e:
                raise FieldError(str(e), key) from None
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, (int, float, bool, BaseModel)) and value is not None:
            check_unicode(value, info.field_name)
        return value


class StreamOptions(_Request):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class _SamplingFields(_Request):
    """Fields shared by both endpoints: OpenAI's plus vLLM's extensions."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    n: StrictInt = 1
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: Number | None = 0.0
    frequency_penalty: Number | None = 0.0
    repetition_penalty: Number | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: the prefix cache's isolation key (a tenant's prefixes never serve another salt)
    cache_salt: str | None = None
    logit_bias: dict[str, Number] | None = (
        # OpenAI: token id (as a string) -> bias, clamped to [-100, 100]
        None
    )
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    # OpenAI / vLLM fields this server does not implement: accepted at their neutral value, a 400 naming the field
    # otherwise (never silently ignored: each would change the output)
    prompt_logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    use_beam_search: StrictBool = False
    truncate_prompt_tokens: StrictInt | None = None
    # structured outputs: vLLM's object (StructuredOutputsParams' fields) or OpenAI's; at most one of them
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # removed in vLLM 0.12 (GUIDED_FIELDS): a 400 naming the replacement, whatever the value's type
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return value

    @field_validator(*LIST_LIMITS, mode="before")
    @classmethod
    def _bounded(cls, value: Any, info: ValidationInfo) -> Any:
        limit = LIST_LIMITS[info.field_name]
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise ValueError(f"{info.field_name} may hold at most {limit} entries, got {len(value)}")
        return value

    def unsupported(self) -> list[str]:
        """Names of the fields set to something this server would have to ignore."""
        bad = ["truncate_prompt_tokens"] if self.truncate_prompt_tokens is not None else []
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.use_beam_search:
            bad.append("use_beam_search")
        return bad

    def constraint_field(self) -> str | None:
        """The request field the output constraint came from (None without one)."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        fmt = self.response_format
        return "response_format" if fmt is not None and fmt.get("type") != "text" else None

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint of structured_outputs or response_format, None without one; FieldError naming
        the field."""
        for name, key in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                raise FieldError(
                    f'{name} was removed in vLLM 0.12; use {{"structured_outputs": {{"{key}": ...}}}} instead.',
                    name,
                )
        fmt = _response_format(self.response_format)
        if self.structured_outputs is None:
            return fmt
        if fmt is not None:
            raise FieldError(
                "response_format and structured_outputs both constrain the output; set only one of them.",
                "response_format",
            )
        try:
            return StructuredOutputsParams.from_dict(self.structured_outputs)
        except ValueError as e:
            raise FieldError(str(e), "structured_outputs") from None

    def constraint_error(self, e: ValueError) -> FieldError:
        """A constraint that does not compile (LLMEngine.grammar_for's error) as a 400 naming the request field
        it came from."""
        field = self.constraint_field()
        msg = str(e)
        if field == "response_format":
            msg = msg.replace("structured_outputs.json", "response_format.json_schema.schema", 1)
            msg = msg.replace("structured_outputs.structural_tag", "response_format", 1)
        return FieldError(msg, field)

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Build SamplingParams (prompt_logprobs: an override, e.g. for echo); raises ValueError naming the bad
        field (passed through as a 400)."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        bad = self.unsupported()
        if bad:
            raise ValueError(f"{bad[0]} is not supported by this server (set: {', '.join(bad)})")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}.")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream=true by this server")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            structured_outputs=self.structured(),
        )

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): max(-100.0, min(100.0, v)) for k, v in self.logit_bias.items()}
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {list(self.logit_bias)[:5]}") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: usage (tokens so far) in every chunk."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


def _response_format(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format as a constraint: None for {"type": "text"}; FieldError naming the field."""
    kind = None if fmt is None else fmt.get("type")
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "structural_tag":
        # vLLM's: {"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}
        tag = {k: fmt.get(k) for k in ("structures", "triggers")}
        return StructuredOutputsParams(structural_tag=json.dumps(tag))
    if kind != "json_schema":
        allowed = ", ".join(repr(t) for t in RESPONSE_FORMAT_TYPES)
        raise FieldError(f"response_format.type must be one of {allowed}, got {kind!r}.", "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise FieldError(
            'response_format.json_schema must be an object {"name": ..., "schema": {...}} when '
            f'response_format.type is "json_schema", got {spec!r}.',
            "response_format",
        )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise FieldError(
            f"response_format.json_schema.schema must be a JSON schema object, got {schema!r}.",
            "response_format",
        )
    for key, kinds in (("name", str), ("description", (str, type(None))), ("strict", (bool, type(None)))):
        if not isinstance(spec.get(key), kinds):
            raise FieldError(
                f"response_format.json_schema.{key} must be a {'string' if key != 'strict' else 'bool'}, "
                f"got {spec.get(key)!r}.",
                "response_format",
            )
    return StructuredOutputsParams(json=schema)


class CompletionRequest(_SamplingFields):
    # token ids: no true/false or 1.0 coerced
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    # OpenAI's and vLLM's default for completions
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + (["suffix"] if self.suffix else [])

    def requested_logprobs(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.")
        return self.logprobs


class ChatMessage(_Request):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # a tool flow's assistant turn ([{"id", "type": "function", "function": {"name", "arguments"}}]) and the
    # tool's answer to one of its calls
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, call in enumerate(calls or []):
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(
                    f"tool_calls[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
                )
            if not isinstance(fn.get("arguments"), (str, dict, type(None))):
                raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON string or an object")
        return calls

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it: role and text content, plus name, tool_calls and
        tool_call_id when set. A call's arguments given as JSON text are parsed into an object, as vLLM does (tool
        templates render `arguments | tojson`); text that is not JSON is passed as given."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            out["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
                for c in self.tool_calls
            ]
        return out

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown role {role!r}; allowed: {', '.join(CHAT_ROLES)}")
        return role

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages may only hold text content parts ({'type': 'text', 'text': ...})")
            parts.append(part["text"])
        return "\n".join(parts)


def _arguments(args: str | dict | None) -> Any:
    """A tool call's arguments for the chat template: JSON text parsed (None or empty: {}), as vLLM does."""
    if not args:
        return {}
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    # OpenAI tool calling (verispec/server/tools.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def tool_plan(self) -> T.ToolChoice:
        """The validated tools and resolved tool_choice (vLLM's default: "auto" with tools, "none" without);
        FieldError naming tools or tool_choice."""
        try:
            return T.resolve_choice(self.tools, self.tool_choice)
        except T.ToolError as e:
            raise FieldError(str(e), e.field) from None

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint: structured_outputs / response_format, or the tool calls of a "required" or named
        tool_choice (never both: FieldError naming tool_choice)."""
        own = super().structured()
        plan = self.tool_plan()
        tool = T.constraint(plan)
        if tool is not None and own is not None:
            what = '"required"' if plan.mode == "required" else f"function {plan.name!r}"
            raise FieldError(
                f"tool_choice {what} constrains the output to tool calls; it cannot be combined with "
                f"{super().constraint_field()}.",
                "tool_choice",
            )
        return own if tool is None else tool

    def constraint_field(self) -> str | None:
        field = super().constraint_field()
        return field if field is not None or T.constraint(self.tool_plan()) is None else "tools"

    def constraint_error(self, e: ValueError) -> FieldError:
        err = super().constraint_error(e)
        if err.field == "tools":
            err = FieldError(
                str(err).replace("structured_outputs.json", "the tools' parameters schema", 1), "tools"
            )
        return err

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}.")
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs requires logprobs to be set to true.")
            return None
        return self.top_logprobs or 0


# ---------------------------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# vLLM's prompt_logprobs entries: {token id: this}
class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


def json_logprob(x: float) -> float:
    # JSON has no -inf (vLLM clamps the same way)
    return max(x, -9999.0)


def prompt_logprobs(entries: list | None) -> PromptLogprobs | None:
    """RequestOutput.prompt_logprobs (Logprob dataclasses) -> the response field (-inf as -9999.0, as logprobs)."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            t: PromptLogprob(logprob=json_logprob(v.logprob), rank=v.rank, decoded_token=v.decoded_token)
            for t, v in e.items()
        }
        for e in entries
    ]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extension
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict | None = (
        # vLLM's extension: extract_hidden_states' {"hidden_states_path": ...}
        None
    )
    # vLLM's extension (--per-request-spec-decode-metrics): {"speculative_decoding": {...}}
    metrics: dict | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    # JSON text
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    # vLLM's extension
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's extension (first choice's request, as vLLM reports it)
    kv_transfer_params: dict | None = None
    # vLLM's extension (--per-request-spec-decode-metrics): {"speculative_decoding": {...}}
    metrics: dict | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed tool call's part: the first names it (id, type, function.name), later ones add arguments text;
    the client joins them by index."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @field_serializer("tool_calls")
    def _only_given_parts(self, calls: list[DeltaToolCall] | None) -> list[dict] | None:
        """A tool call delta's unset parts are left out, not null: the openai client merges every key it gets
        (a null `type` in a later delta would replace "function")."""
        return None if calls is None else [c.model_dump(exclude_none=True) for c in calls]


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    # on the last chunk (--per-request-spec-decode-metrics)
    metrics: dict | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "verispec"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    503: "ServiceUnavailableError",
    500: "InternalServerError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "APIError"), param=param, code=status)
    return ErrorResponse(error=info).model_dump()
