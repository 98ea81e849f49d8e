"""OpenAI request/response models for /v1/completions and /v1/chat/completions (vLLM's extra fields included).

Unknown request fields are ignored, as OpenAI and vLLM do; known ones this server does not implement
(prompt_logprobs, response_format, tools, ...) are a 400 naming the field unless left at their neutral value. Types
are strict (no "4" or true for an integer, only finite numbers), list fields have limits (LIST_LIMITS), and a lone
UTF-16 surrogate anywhere, unknown fields included, is a 400. Errors use OpenAI's nested shape
`{"error": {"message", "type", "param", "code"}}` so the `openai` client raises the right exception class.
"""

from __future__ import annotations

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
    field_validator,
    model_validator,
)

from verispec.sampling_params import SamplingParams

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
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    truncate_prompt_tokens: StrictInt | None = None

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
        bad = [
            name
            for name in (
                "structured_outputs",
                "guided_json",
                "guided_regex",
                "guided_choice",
                "guided_grammar",
                "truncate_prompt_tokens",
            )
            if getattr(self, name) not in (None, {}, [])
        ]
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.use_beam_search:
            bad.append("use_beam_search")
        if self.response_format and self.response_format.get("type", "text") != "text":
            bad.append("response_format")
        return bad

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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + (["tools"] if self.tools else [])
        return bad + (["tool_choice"] if self.tool_choice not in (None, "none", "auto") else [])

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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
