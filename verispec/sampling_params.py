"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass, field
from numbers import Real

# Temperatures below this are treated as greedy (argmax), as in vLLM.
SAMPLING_EPS = 1e-5


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return value


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r} (bool).")
    try:
        # accepts int and numpy integers, rejects floats/str
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).") from None


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__}).")
    return value


# the constraint kinds of StructuredOutputsParams, exactly one per request
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: the output follows a JSON schema (`json`, a dict or its JSON text), any JSON object
    (`json_object`), a regular expression, one of a list of strings (`choice`), a context-free grammar (`grammar`:
    Lark or GBNF) or tagged segments in free text (`structural_tag`). Exactly one kind per request. The grammar is compiled when the request is added
    (verispec/sample/grammar.py)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's structural tag (JSON text or its object): free text in which each `structures[i].begin` (starting with one
    # of `triggers`) opens a segment that follows `structures[i].schema` and closes with its `end` (tool calls inside
    # prose, e.g. `<function=get_weather>{...}</function>`)
    structural_tag: str | dict | None = None
    # JSON only: no whitespace outside strings; `additionalProperties: false` wherever the schema is silent
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # JSON only: the regex of whitespace between tokens
    whitespace_pattern: str | None = None
    # accepted for vLLM compatibility: verispec has one backend (llguidance), so there is nothing to fall back to
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) > 1:
            raise ValueError(
                "You can only use one kind of structured outputs constraint but multiple are specified: "
                f"{', '.join(given)}."
            )
        if not given:
            raise ValueError(
                "You must use one kind of structured outputs constraint but none are specified "
                f"(one of {', '.join(STRUCTURED_KINDS)})."
            )
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (an object or its JSON text), got {self.json!r}."
            )
        for name in ("regex", "grammar", "whitespace_pattern", "structural_tag"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}.")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}."
                )
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}.")
            self.choice = list(self.choice)
        if self.json_object is not None:
            _as_bool("structured_outputs.json_object", self.json_object)
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            _as_bool(f"structured_outputs.{name}", getattr(self, name))

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, d: object) -> StructuredOutputsParams:
        """From a request body's `structured_outputs` object: unknown keys are a ValueError naming them."""
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {d!r}.")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown keys {unknown}; allowed: {', '.join(sorted(known))}."
            )
        return cls(**d)


@dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM semantics).

    temperature == 0 means greedy. top_k of 0 or -1 disables top-k (both are accepted, as in vLLM).
    ``stop`` is normalised to a list of strings and ``stop_token_ids`` to a list of ints.
    max_tokens=None means "up to the model's context length" (vLLM semantics).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # top-N logprobs per prompt token (the first is None), as vLLM
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> added to its logit (before the penalties), as in vLLM
    logit_bias: dict[int, float] | None = None
    # only these tokens can be sampled
    allowed_token_ids: list[int] | None = None
    # words whose last token is banned when the output ends with the rest
    bad_words: list[str] | None = None
    # the output follows a JSON schema, regex, choice or grammar
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._normalise_types()
        self._verify_args()

    def _normalise_types(self) -> None:
        self.n = _as_int("n", self.n)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            setattr(self, name, _as_float(name, getattr(self, name)))
        self.top_k = _as_int("top_k", self.top_k)
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
            # vLLM: -1 means "no seed"
            if self.seed == -1:
                self.seed = None
            elif not -(2**63) <= self.seed < 2**63:
                raise ValueError(f"seed must be a 64-bit integer (-2**63 .. 2**63 - 1), got {self.seed}.")
        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens)
        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _as_int("prompt_logprobs", self.prompt_logprobs)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            setattr(self, name, _as_bool(name, getattr(self, name)))
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}.")
            self.logit_bias = {
                _as_int("logit_bias", k): _as_float("logit_bias", v) for k, v in self.logit_bias.items()
            }
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}.")
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}.")
            self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes)) or not hasattr(
                self.allowed_token_ids, "__iter__"
            ):
                raise ValueError(
                    f"allowed_token_ids must be a list of integers, got {self.allowed_token_ids!r}."
                )
            self.allowed_token_ids = [_as_int("allowed_token_ids", i) for i in self.allowed_token_ids]
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

    def _verify_args(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero (in (0, inf)), got {self.repetition_penalty}."
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if self.logit_bias and any(t < 0 for t in self.logit_bias):
            raise ValueError(f"logit_bias token ids must be non-negative, got {sorted(self.logit_bias)[:5]}.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token).")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be non-negative, got {self.allowed_token_ids[:5]}.")

    def check_vocab(self, vocab: int) -> None:
        """ValueError naming the field if a token id is outside [0, vocab) or more logprobs than tokens are asked
        for (the engine knows the vocabulary)."""
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and n > vocab:
                raise ValueError(f"{name}={n} is more than the vocabulary size ({vocab})")
        for name, ids in (
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether presence, frequency or repetition penalties change the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Explicit stop token ids. The engine adds the EOS id itself unless ``ignore_eos``."""
        return set(self.stop_token_ids)


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}.")
    if any(s == "" for s in stop):
        raise ValueError("stop cannot contain an empty string.")
    return list(stop)


def _normalise_stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}.")
    out = [_as_int("stop_token_ids", i) for i in ids]
    if any(i < 0 for i in out):
        raise ValueError(f"stop_token_ids must be non-negative integers, got {out}.")
    return out
