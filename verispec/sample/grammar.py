"""Structured outputs on llguidance: grammars compiled once per constraint, one matcher per request, the token masks
of a step's verified positions computed in one parallel call, and the drafts a grammar refuses or forces.

llguidance (one of vLLM's two backends) was picked over xgrammar for three reasons: it installs without
dependencies (xgrammar pulls torch, triton and transformers), it computes masks lazily per position without a
per-schema precompilation over the vocabulary (schemas change with every request), and it has the primitives
speculation needs: `validate_tokens` (where a draft first breaks the grammar), masks at every draft position
(`unsafe_compute_mask_ptr_with_draft_token`), `rollback`, and `compute_ff_tokens` (the tokens the grammar forces).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance as llg
import numpy as np
import torch

from verispec.sampling_params import StructuredOutputsParams

# compiled constraints kept per engine (a matcher template each; requests take deep copies)
CACHE_SIZE = 256


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked). ValueError naming the field when the schema or
    choice list cannot be read."""
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r}.")
        if so.disable_additional_properties and isinstance(schema, dict):
            schema = _no_additional_properties(schema)
        options: dict = {"whitespace_flexible": not so.disable_any_whitespace}
        if so.whitespace_pattern is not None:
            options["whitespace_pattern"] = so.whitespace_pattern
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: {e}") from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    if kind == "structural_tag":
        return _structural_tag(so.structural_tag)
    try:
        return llg.grammar_from("grammar", so.grammar)
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar: {e}") from None


def _structural_tag(text: str) -> str:
    """vLLM's structural tag {"structures": [{"begin", "schema", "end"}], "triggers": [...]} as llguidance's: free
    text in which a trigger opens a segment `begin` + JSON under `schema` + `end` (as vLLM's guidance backend,
    schemas read leniently: unknown keywords ignored). ValueError naming the field."""
    where = "structured_outputs.structural_tag"
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None
    structures = spec.get("structures") if isinstance(spec, dict) else None
    triggers = spec.get("triggers") if isinstance(spec, dict) else None
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{where}.structures must be a non-empty list of {{begin, schema, end}} objects")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{where}.triggers must be a non-empty list of strings")
    tags = []
    for i, st in enumerate(structures):
        if not isinstance(st, dict) or not all(isinstance(st.get(k), str) for k in ("begin", "end")):
            raise ValueError(f"{where}.structures[{i}] must have string 'begin' and 'end'")
        schema = st.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError(f"{where}.structures[{i}].schema must be a JSON schema object")
        trigger = next((t for t in triggers if st["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(
                f"{where}.structures[{i}].begin {st['begin']!r} starts with none of the triggers {triggers}"
            )
        grammar = {"x-guidance": {"lenient": True}, **schema}
        tags.append(llg.StructTag(trigger=trigger, begin=st["begin"], grammar=grammar, end=st["end"]))
    return llg.StructTag.to_grammar(tags)


def _no_additional_properties(schema: dict) -> dict:
    """vLLM's disable_additional_properties: `additionalProperties: false` on every object schema that does not say."""
    out = {k: _walk(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def _walk(v):
    if isinstance(v, dict):
        return _no_additional_properties(v)
    if isinstance(v, list):
        return [_walk(x) for x in v]
    return v


def _key(so: StructuredOutputsParams) -> str:
    """A constraint's cache key: every field that changes the grammar."""
    fields = {k: getattr(so, k) for k in so.__dataclass_fields__ if k != "disable_fallback"}
    return json.dumps(fields, sort_keys=True, default=str)


class GrammarCompiler:
    """One engine's grammars: the tokenizer llguidance reads, the compiled constraints (LRU), the thread pool that
    computes a step's masks."""

    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | list[int], threads: int = 0
    ):
        """tokenizer: verispec.tokenizer.Tokenizer; vocab_size: the model's logits width (may exceed the
        tokenizer's: the extra ids are never allowed)."""
        eos = list(eos_token_ids) or None
        self.tokenizer = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.executor = llg.LLExecutor(threads or min(4, os.cpu_count() or 1))
        self._cache: OrderedDict[str, llg.LLMatcher] = OrderedDict()

    def matcher(self, so: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for a request. ValueError naming the field for a bad schema, regex or grammar."""
        key = _key(so)
        template = self._cache.get(key)
        if template is None:
            text = grammar_text(so)
            err = llg.LLMatcher.validate_grammar(text, self.tokenizer)
            if err and not err.startswith("WARNING"):
                raise ValueError(f"structured_outputs.{so.kind} is not a valid constraint: {err}")
            template = llg.LLMatcher(self.tokenizer, text, log_level=0)
            if template.is_error():
                raise ValueError(
                    f"structured_outputs.{so.kind} is not a valid constraint: {template.get_error()}"
                )
            self._cache[key] = template
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return GrammarState(template.deep_copy(), self)


@dataclass
class GrammarState:
    """A request's matcher: it has consumed exactly the request's committed output tokens."""

    matcher: llg.LLMatcher
    compiler: GrammarCompiler

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of the drafts the grammar admits in a row (the first refused one and all after it are cut)."""
        return self.matcher.validate_tokens(drafts) if drafts else 0

    def forced(self, after: list[int]) -> list[int]:
        """The tokens the grammar forces after `after` (drafts it admits): its only continuation, as tokens."""
        m = self.matcher
        if after and not m.consume_tokens(after):
            raise RuntimeError(f"grammar refused admitted drafts: {m.get_error()}")
        try:
            return [] if m.is_stopped() else m.compute_ff_tokens()
        finally:
            if after:
                m.rollback(len(after))

    def accept(self, tokens: list[int]) -> bool:
        """Advance past committed tokens (each sampled under this grammar's mask; past the grammar's end only EOS
        is, which ignore_eos keeps committing). False if the grammar refuses them (a bug: the request is ended,
        the batch goes on)."""
        if self.matcher.is_stopped() or not tokens:
            return True
        return self.matcher.consume_tokens(tokens)

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def masks(states: list[GrammarState], drafts: list[list[int]]) -> torch.Tensor:
    """int32 bitmasks [sum(len(d) + 1), W] (bit t of word t // 32: token t allowed) of every verified position of
    each request in order: after its committed tokens, then after each of its drafts (which the grammar admits).
    One call into llguidance's thread pool for the whole step."""
    compiler = states[0].compiler
    starts, n = [], 0
    for d in drafts:
        starts.append(n)
        n += len(d) + 1
    out = torch.full((n, compiler.words), -1, dtype=torch.int32)
    ex, ptr, size = compiler.executor, out.data_ptr(), compiler.words * 4
    # llguidance takes the positions without drafts and those with apart
    plain = [(s.matcher, i) for s, i, d in zip(states, starts, drafts) if not d]
    drafted = [(s.matcher, i, d) for s, i, d in zip(states, starts, drafts) if d]
    if plain:
        ex.unsafe_compute_mask_ptr(plain, ptr, size, n)
    if drafted:
        ex.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, size, n)
    return out


def refused(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmasks [R, W] (CPU) -> bool [R, vocab], True where the token is refused: numpy unpacks the inverted
    words' bits (little-endian: bit t of word t // 32 is byte t // 8's bit t % 8) without an [R, W, 32] temporary."""
    bits = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


class LazyGrammars:
    """An engine's grammars: the GrammarCompiler built on the first constrained request (the tokenizer's vocabulary
    is read once), safe to call from any thread (the server compiles off the engine's)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def matcher_for(self, params) -> GrammarState | None:
        """The matcher of params.structured_outputs (None without one), compiled or from the cache; ValueError
        naming the field for a bad constraint."""
        so = params.structured_outputs
        if so is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer (skip_tokenizer_init=True was given)")
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._compiler.matcher(so)
