"""Tokenizer wrapper around `tokenizers.Tokenizer`, plus incremental detokenisation.

A `Tokenizer` is built either from a Hugging Face model directory (`tokenizer.json` and friends) or
from the `tokenizer.*` metadata of a GGUF file. The GGUF builders mirror transformers' GGUF tokenizer
conversion (`transformers/integrations/gguf/gguf_tokenizer_mapping.py`), with the pre-tokenizer split
chosen from `tokenizer.ggml.pre` the way llama.cpp does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from verispec.loader.files import read_json

# llama.cpp token types (gguf.TokenType)
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# Token texts llama.cpp treats as end-of-generation, besides the eos/eot/eom ids the file states.
EOG_TOKEN_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)

# ByteLevel(use_regex=True) applies the GPT-2 regex itself
_GPT2_SPLIT = None
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` values that use the plain GPT-2 regex.
_GPT2_PRES = ("default", "gpt2", "gpt-2", "olmo", "jais", "poro-chat", "viking")
# `tokenizer.ggml.pre` values that split every \p{N} character off first, then apply the GPT-2 regex
# (llama.cpp's regex list for these; SmolLM's own tokenizer.json is Digits(individual) + ByteLevel).
# transformers' GGUF conversion uses the plain GPT-2 regex for "smollm", which differs from both on
# non-ASCII numerals such as "½" (ASCII digits come out the same: the vocabulary has no digit merges).
_DIGIT_GPT2_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
# `tokenizer.ggml.pre` values with their own split regex, applied before a regex-less ByteLevel.
_REGEX_PRES = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
}
SUPPORTED_GGUF_PRE_TYPES = tuple(sorted((*_GPT2_PRES, *_DIGIT_GPT2_PRES, *_REGEX_PRES)))

# Architectures whose sentencepiece (`llama` model) vocabulary gets the Gemma treatment.
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


class Tokenizer:
    """A `tokenizers.Tokenizer` with the special-token facts and chat template an engine needs."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
        pad_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.pad_token_id = pad_token_id

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`) from a directory."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{root}: no tokenizer.json found")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        # the tokenizers library raises a bare Exception for malformed files
        except Exception as e:
            raise ValueError(f"{tokenizer_file}: not a valid tokenizer file ({e})") from None
        config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")

        bos = _token_id(backend, config.get("bos_token"))
        eos_ids = _as_id_list(generation.get("eos_token_id"))
        eos = _token_id(backend, config.get("eos_token"))
        if eos is not None:
            eos_ids.append(eos)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            chat_template=_hf_chat_template(root, config),
            add_bos_token=bool(config.get("add_bos_token", False)),
            pad_token_id=_token_id(backend, config.get("pad_token")),
        )

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], architecture: str) -> Tokenizer:
        """Build from GGUF metadata (`tokenizer.ggml.*` keys, values already decoded to Python)."""
        model = fields.get("tokenizer.ggml.model")
        if model == "gpt2":
            backend = _byte_level_backend(fields)
        elif model == "llama":
            backend = _sentencepiece_backend(fields, architecture)
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {model!r} (supported: 'gpt2', 'llama')")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        _add_gguf_added_tokens(backend, fields)

        bos = fields.get("tokenizer.ggml.bos_token_id")
        add_bos = fields.get("tokenizer.ggml.add_bos_token", model == "llama")
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=gguf_eos_token_ids(fields, tokens),
            chat_template=fields.get("tokenizer.chat_template"),
            add_bos_token=bool(add_bos) and bos is not None,
            pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
        )

    # ---- encode / decode ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template, as transformers' `apply_chat_template`."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        context: dict[str, Any] = {
            "tools": None,
            "documents": None,
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id),
        }
        context.update(kwargs)
        template = compile_chat_template(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.backend.id_to_token(token_id) or ""


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas, vLLM-style.

    Only a short window of recent tokens is decoded per token (`prefix_offset:`), compared with the
    decode of the already-emitted part of that window (`prefix_offset:read_offset`). Text ending in
    U+FFFD (an incomplete UTF-8 sequence) is held back until a later token completes it.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(self.token_ids)
        # A few prompt tokens of context so the first output token gets its leading space right.
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - 5, 0)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All output text finalised so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def add_tokens(self, ids: Iterable[int]) -> str:
        """Append `ids`; return the text that became final because of them (possibly empty)."""
        delta = "".join(self._add_one(token_id) for token_id in ids)
        if delta:
            self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """Emit any held-back text (e.g. at end of generation), even if it ends in U+FFFD."""
        prefix_text, new_text = self._decode_window()
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        if delta:
            self._chunks.append(delta)
        return delta

    def _add_one(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset], skip)
        new_text = decode(self.token_ids[self.prefix_offset :], skip)
        return prefix_text, new_text


# ---- chat templates ---------------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured like transformers'."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# ---- HF directory helpers ---------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    """An optional JSON object file: {} if absent; ValueError naming it if malformed."""
    return read_json(path) if path.is_file() else {}


def _token_id(backend: HFTokenizer, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return backend.token_to_id(token)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _hf_chat_template(root: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    # [{"name": "default", "template": "..."}, ...]
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        return template
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return _read_json(root / "chat_template.json").get("chat_template")


# ---- GGUF builders ----------------------------------------------------------------------------


def gguf_eos_token_ids(fields: Mapping[str, Any], tokens: Sequence[str]) -> list[int]:
    """eos, eot and eom ids from the file, then llama.cpp's end-of-generation tokens found by text."""
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = fields.get(key)
        if value is not None and 0 <= value < len(tokens):
            ids.append(int(value))
    types = fields.get("tokenizer.ggml.token_type")
    for index, token in enumerate(tokens):
        if token in EOG_TOKEN_TEXTS and (
            types is None or types[index] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        ):
            ids.append(index)
    return list(dict.fromkeys(ids))


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _byte_level_backend(fields: Mapping[str, Any]) -> HFTokenizer:
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    merges = _gguf_merges(fields, vocab)
    backend = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(fields.get("tokenizer.ggml.pre") or "default")
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_GPT2_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _REGEX_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_PRES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(
        f"unsupported GGUF pre-tokenizer type {pre!r}; supported: {', '.join(SUPPORTED_GGUF_PRE_TYPES)}"
    )


def _sentencepiece_backend(fields: Mapping[str, Any], architecture: str) -> HFTokenizer:
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    if architecture in _GEMMA_ARCHS:
        return _gemma_backend(tokens)
    scores = fields.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError("GGUF sentencepiece vocabulary has no tokenizer.ggml.scores")
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _gguf_merges(fields, vocab, dict(zip(tokens, scores)))
    backend = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _gemma_backend(tokens: list[str]) -> HFTokenizer:
    """Gemma: tokens made of spaces are respelled with '▁', merges follow file order (not scores)."""
    respelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    positions = {token: -index for index, token in enumerate(respelled)}
    merges = merges_from_vocab(vocab, positions)
    unk = "<unk>" if "<unk>" in vocab else None
    backend = HFTokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def _gguf_merges(
    fields: Mapping[str, Any], vocab: dict[str, int], scores: dict[str, float] | None = None
) -> list[tuple[str, str]]:
    merges = fields.get("tokenizer.ggml.merges")
    if merges is not None:
        return [tuple(merge.split(" ")) for merge in merges]  # type: ignore[misc]
    return merges_from_vocab(vocab, scores)


def merges_from_vocab(vocab: dict[str, int], scores: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: every split of a token into two tokens.

    Ordered like transformers' `generate_merges`: by the merged token's score, best first (or by id
    when there are no scores), then by the left piece's length, longest first.
    """
    reverse = scores is not None
    ranked = scores if scores is not None else vocab
    merges = []
    for merged, score in ranked.items():
        local = []
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            left_id = vocab.get(left)
            if left_id is not None:
                right_id = vocab.get(right)
                if right_id is not None:
                    local.append((left_id, right_id, left, right))
        local.sort()
        merges.extend((score, len(left), len(right), left, right) for _, _, left, right in local)
    merges.sort(key=lambda m: (m[0], m[1], m[2]), reverse=reverse)
    return [(m[3], m[4]) for m in merges]


def _add_gguf_added_tokens(backend: HFTokenizer, fields: Mapping[str, Any]) -> None:
    """Control tokens become special added tokens; user-defined ones plain added tokens."""
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type")
    if types is None:
        return
    alphabet = set(bytes_to_unicode().values()) if fields.get("tokenizer.ggml.model") == "gpt2" else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, types)
        if kind == TOKEN_CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    user = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, types)
        if kind == TOKEN_USER_DEFINED and token in vocab
    ]
    if user:
        backend.add_tokens(user)
