"""Cross-tokenizer drafting (`use_heterogeneous_vocab`): the map between a draft's vocabulary and the target's.

Token-Level Intersection (TLI, Timor et al., "Lossless Speculative Decoding Algorithms for Heterogeneous
Vocabularies", ICML 2025): the draft proposes only tokens whose text both vocabularies hold, mapped to the target's
ids. Every token is normalised to the bytes it stands for, so spellings of the same text match across tokenizer
families: GPT-2 byte-level pieces ('Ġthe', 'Ã©') are read back through GPT-2's byte table, SentencePiece pieces
('▁the', 'é') have '▁' read as a space, and byte-fallback pieces ('<0xE2>') are their one byte, so a byte-level
vocabulary's single-byte tokens meet a SentencePiece vocabulary's byte tokens. (vLLM compares strings with the space
marker replaced, which misses non-ASCII text and byte tokens.) Special tokens (control tokens such as '<|im_end|>')
match only special tokens of the same content. Where several ids of one vocabulary stand for the same bytes, the one
its tokenizer emits wins (a normal piece over a byte-fallback piece, then the lowest id), so the map is one-to-one.

The draft reads the target's context in its own vocabulary: each committed target token becomes the draft tokens
spelling the same bytes (one token when it is in the intersection, else a longest-match split over the draft's
vocabulary; a special token without a counterpart becomes nothing). Speculation stays lossless whatever the draft
reads: the map only decides which tokens get proposed.

Pure functions and plain tensors: the tests build maps from token lists, without a model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from verispec.tokenizer import bytes_to_unicode

# a normal token's text as bytes, or a special token's content as str (never equal to each other)
Key = bytes | str

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def piece_bytes(piece: str, byte_level: bool, byte_fallback: bool) -> tuple[bytes, bool]:
    """One vocabulary piece -> (the bytes it stands for, whether it is a byte-fallback piece)."""
    if byte_fallback:
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)]), True
    if byte_level:
        table = _unicode_to_byte()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece), False
        return piece.encode("utf-8"), False
    return piece.replace("\u2581", " ").encode("utf-8"), False


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's printable character -> the byte it spells."""

    return {c: b for b, c in bytes_to_unicode().items()}


@dataclass(frozen=True)
class VocabKeys:
    """A vocabulary normalised: keys[i] is token i's Key (None: no such token); fallback[i] marks byte-fallback
    pieces (kept to prefer normal pieces); bos: the id the tokenizer puts first, if it adds one."""

    keys: list[Key | None]
    fallback: list[bool]
    bos: int | None = None
    unk: int | None = None


def vocab_keys(
    pieces: Sequence[str | None],
    special: Iterable[int] = (),
    byte_level: bool = False,
    byte_fallback: bool = False,
    bos: int | None = None,
    unk: int | None = None,
) -> VocabKeys:
    """Normalise a vocabulary given as pieces by id (the tokenizer's own spelling) and its special ids."""
    special = set(special)
    keys: list[Key | None] = []
    fallback = []
    for i, piece in enumerate(pieces):
        if piece is None:
            keys.append(None)
            fallback.append(False)
        elif i in special:
            keys.append(piece)
            fallback.append(False)
        else:
            b, fb = piece_bytes(piece, byte_level, byte_fallback)
            keys.append(b if b else None)
            fallback.append(fb)
    return VocabKeys(keys, fallback, bos, unk)


def tokenizer_keys(tokenizer) -> VocabKeys:
    """vocab_keys of a verispec Tokenizer: the decoder says whether pieces are GPT-2 byte-level and whether
    '<0xNN>' pieces are byte fallback; added tokens marked special are special."""
    backend = tokenizer.backend
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    vocab = backend.get_vocab(with_added_tokens=True)
    pieces: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for piece, i in vocab.items():
        pieces[i] = piece
    special = [i for i, t in backend.get_added_tokens_decoder().items() if t.special]
    bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None
    unk = backend.token_to_id("<unk>")
    return vocab_keys(pieces, special, "ByteLevel" in kinds, "ByteFallback" in kinds, bos, unk)


def _representatives(v: VocabKeys, size: int) -> dict[Key, int]:
    """Key -> the one id standing for it: a normal piece before a byte-fallback one, then the lowest id; ids at or
    past `size` (the model's rows) are left out."""
    out: dict[Key, int] = {}
    n = min(size, len(v.keys))
    for i in sorted(range(n), key=lambda i: (v.fallback[i], i)):
        k = v.keys[i]
        if k is not None and k not in out:
            out[k] = i
    return out


@dataclass
class VocabMap:
    """The intersection of a draft's and a target's vocabularies, and the translation of target tokens into the
    draft's. Tensors live on the draft's device (`to`)."""

    # [Vd] long: the target id of each draft id in the intersection, -1 elsewhere
    draft_to_target: torch.Tensor
    # [Vd] bool: draft ids the draft may propose
    draft_mask: torch.Tensor
    # [I] long, [I] long: the intersection as parallel id lists
    draft_ids: torch.Tensor
    target_ids: torch.Tensor
    target_vocab: int
    # target id -> its Key; draft Key -> draft id; the draft's longest normal key in bytes
    target_keys: list[Key | None]
    draft_index: dict[Key, int]
    max_key_len: int
    draft_bos: int | None = None
    draft_unk: int | None = None
    _cache: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())

    def to(self, device: torch.device | str) -> VocabMap:
        for name in ("draft_to_target", "draft_mask", "draft_ids", "target_ids"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def translate(self, target_id: int) -> tuple[int, ...]:
        """The draft ids spelling target token `target_id`'s bytes (cached per id)."""
        out = self._cache.get(target_id)
        if out is None:
            key = self.target_keys[target_id] if 0 <= target_id < len(self.target_keys) else None
            out = self._cache[target_id] = split_key(key, self.draft_index, self.max_key_len, self.draft_unk)
        return out

    def translate_ids(self, target_ids: Iterable[int], first: bool = False) -> list[int]:
        """Target ids -> draft ids; `first`: they open the context, so the draft's BOS goes first (once) when its
        tokenizer adds one."""
        out = [d for t in target_ids for d in self.translate(t)]
        if first and self.draft_bos is not None and out[:1] != [self.draft_bos]:
            out.insert(0, self.draft_bos)
        return out

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, Vd] -> [N, Vd]: -inf outside the intersection, so the draft picks and q live on it."""
        return logits.masked_fill(~self.draft_mask, float("-inf"))

    def to_target(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Draft ids in the intersection [...] -> the target's ids [...]."""
        return self.draft_to_target[draft_tokens]

    def target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """[N, Vd] draft probabilities (zero outside the intersection) -> [N, Vt]: the same law over the target's
        ids, zero on target tokens the draft cannot propose."""
        out = q.new_zeros(q.shape[0], self.target_vocab)
        out[:, self.target_ids] = q[:, self.draft_ids]
        return out


def split_key(key: Key | None, index: dict[Key, int], max_len: int, unk: int | None) -> tuple[int, ...]:
    """A target token's Key -> draft ids: a special key maps to the same special token or to nothing; bytes are
    split greedily into the longest draft keys (a byte no draft key starts with becomes `unk`, or is dropped)."""
    if key is None:
        return ()
    if isinstance(key, str):
        i = index.get(key)
        return () if i is None else (i,)
    out: list[int] = []
    pos = 0
    while pos < len(key):
        for n in range(min(max_len, len(key) - pos), 0, -1):
            i = index.get(key[pos : pos + n])
            if i is not None:
                out.append(i)
                pos += n
                break
        else:
            if unk is not None:
                out.append(unk)
            pos += 1
    return tuple(out)


def build_vocab_map(target: VocabKeys, draft: VocabKeys, target_vocab: int, draft_vocab: int) -> VocabMap:
    """The map between a target vocabulary of `target_vocab` model rows and a draft one of `draft_vocab` rows.
    ValueError when the two share no token."""
    t_rep, d_rep = _representatives(target, target_vocab), _representatives(draft, draft_vocab)
    common = sorted(d_rep[k] for k in t_rep.keys() & d_rep.keys())
    if not common:
        raise ValueError(
            "use_heterogeneous_vocab: the draft's and the target's vocabularies share no token; nothing to propose"
        )
    draft_ids = torch.tensor(common, dtype=torch.long)
    target_ids = torch.tensor([t_rep[draft.keys[d]] for d in common], dtype=torch.long)
    d2t = torch.full((draft_vocab,), -1, dtype=torch.long)
    d2t[draft_ids] = target_ids
    mask = torch.zeros(draft_vocab, dtype=torch.bool)
    mask[draft_ids] = True
    max_len = max((len(k) for k in d_rep if isinstance(k, bytes)), default=1)
    return VocabMap(
        d2t,
        mask,
        draft_ids,
        target_ids,
        target_vocab,
        target.keys[:target_vocab],
        d_rep,
        max_len,
        draft.bos if draft.bos is not None and draft.bos < draft_vocab else None,
        draft.unk if draft.unk is not None and draft.unk < draft_vocab else None,
    )
