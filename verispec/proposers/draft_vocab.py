"""Which token ids a draft model's LM head keeps (`draft_vocab_size` / `draft_vocab_file`, layers/trimmed_head.py).

`draft_vocab_size: N` keeps ids 0 .. N-1: byte-level BPE vocabularies number their tokens in merge order, so the low
ids are the frequent ones (HumanEval's prompts and solutions under Qwen2.5's tokenizer: 96% of tokens below 32,768,
98.7% below 65,536). `draft_vocab_file` reads a chosen set instead: a file of little-endian int32 token ids
(`rank_vocab` + `write_vocab_file`, or `verispec draft-vocab`, make one from a corpus: its most frequent ids, then
the lowest others). Either way the tokenizer's special ids (end of turn, end of text) are added, and the set is
padded with the lowest missing ids to a multiple of 16 rows (the int8 kernels' column group).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

# rows per column group of the int8 kernels: a trimmed head keeps a multiple of it
from verispec.kernels.qweight import GROUP as ROW_GROUP


def read_vocab_file(path: str, vocab_size: int) -> np.ndarray:
    """A draft-vocabulary file (little-endian int32 token ids) -> the ids [n] int64; ValueError naming
    speculative_config.draft_vocab_file for a missing, empty, ragged or out-of-range file."""
    key = "speculative_config.draft_vocab_file"
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{key} {path!r} cannot be read: {e.strerror or e}") from None
    if not raw or len(raw) % 4:
        raise ValueError(
            f"{key} {path!r} is not a draft vocabulary: {len(raw)} bytes, expected little-endian int32 token ids "
            "(a non-empty multiple of 4 bytes)"
        )
    ids = np.frombuffer(raw, dtype="<i4").astype(np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(
            f"{key} {path!r} holds token id {int(bad[0])}, outside the draft's vocabulary [0, {vocab_size})"
        )
    return ids


def special_ids(tokenizer) -> list[int]:
    """The ids a trimmed head always keeps: end of turn / text, bos, pad and the added tokens ([] without a
    tokenizer)."""
    if tokenizer is None:
        return []
    ids = [*tokenizer.eos_token_ids, tokenizer.bos_token_id, tokenizer.pad_token_id]
    ids += list(tokenizer.backend.get_added_tokens_decoder())
    return [i for i in ids if i is not None]


def draft_vocab_ids(
    vocab_size: int, size: int | None = None, path: str | None = None, always: Iterable[int] = ()
) -> torch.Tensor | None:
    """The sorted ids [n] int64 a trimmed head keeps: 0 .. size-1 (or the file's ids), plus `always`, padded to a
    multiple of ROW_GROUP; None when that is the whole vocabulary (nothing to trim)."""
    chosen = read_vocab_file(path, vocab_size) if path is not None else np.arange(min(size or 0, vocab_size))
    extra = np.array([i for i in always if 0 <= i < vocab_size], dtype=np.int64)
    keep = np.union1d(chosen, extra)
    missing = (-keep.size) % ROW_GROUP
    if keep.size + missing >= vocab_size:
        return None
    if missing:
        # the lowest ids not yet kept
        free = np.setdiff1d(np.arange(keep.size + missing), keep)[:missing]
        keep = np.union1d(keep, free)
    return torch.from_numpy(keep)


def rank_vocab(corpus: np.ndarray, size: int, vocab_size: int) -> np.ndarray:
    """The `size` ids to keep for a corpus's token ids [T]: the ids it holds, most frequent first (ties: the lower
    id), then the lowest ids it lacks (byte-level BPE's frequent ones), in that order; int64 [min(size, vocab)]."""
    counts = np.bincount(corpus[(corpus >= 0) & (corpus < vocab_size)], minlength=vocab_size)
    # stable: equal counts keep id order
    order = np.argsort(-counts, kind="stable")
    seen = order[counts[order] > 0]
    rest = np.setdiff1d(np.arange(vocab_size), seen, assume_unique=True)
    return np.concatenate([seen, rest])[: min(size, vocab_size)].astype(np.int64)


def write_vocab_file(path: str, ids: np.ndarray) -> None:
    """Token ids as `draft_vocab_file` reads them: little-endian int32."""
    Path(path).write_bytes(np.asarray(ids, dtype="<i4").tobytes())
