"""The cross-tokenizer vocabulary map (TLI): normalised keys, the one-to-one intersection, the draft mask, the
translation of target tokens into the draft's vocabulary, and the draft law carried over to target ids."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import build_sp_tokenizer, build_tokenizer
from verispec.proposers.vocab_map import VocabKeys, build_vocab_map, piece_bytes, tokenizer_keys, vocab_keys
from verispec.tokenizer import Tokenizer

# a GPT-2 byte-level vocabulary ('Ġ' = space, 'Ã©' = the two UTF-8 bytes of 'é', 'â' = byte 0xE2 alone)
BYTE_LEVEL = ["<|im_end|>", "a", "b", "Ġthe", "Ã©", "â", "Ġ", "<s>", "ab", "Ġcat"]
BYTE_LEVEL_SPECIAL = [0]
# a SentencePiece vocabulary with byte fallback: '▁' = space, '<0xE2>' = byte 0xE2, both '<0x61>' and 'a'
SENTENCEPIECE = [
    "<unk>",
    "<s>",
    "<|im_end|>",
    "<0x61>",
    "<0xE2>",
    "a",
    "▁the",
    "é",
    "b",
    "▁",
    "<0x20>",
    "<|im_end|>x",
]
SENTENCEPIECE_SPECIAL = [0, 1, 2]


def byte_level() -> VocabKeys:
    return vocab_keys(BYTE_LEVEL, BYTE_LEVEL_SPECIAL, byte_level=True)


def sentencepiece(bos: int | None = 1) -> VocabKeys:
    return vocab_keys(SENTENCEPIECE, SENTENCEPIECE_SPECIAL, byte_fallback=True, bos=bos, unk=0)


@pytest.mark.parametrize(
    "piece, byte_level, fallback, expected",
    [
        ("Ġthe", True, False, (b" the", False)),
        ("Ã©", True, False, ("é".encode(), False)),
        ("â", True, False, (b"\xe2", False)),
        ("▁the", False, True, (b" the", False)),
        ("é", False, True, ("é".encode(), False)),
        ("<0xE2>", False, True, (b"\xe2", True)),
        # without byte fallback '<0xE2>' is six characters of text
        ("<0xE2>", False, False, (b"<0xE2>", False)),
        # a byte-level vocabulary's piece outside GPT-2's alphabet is its own text
        ("<x y>", True, False, (b"<x y>", False)),
    ],
)
def test_pieces_are_normalised_to_the_bytes_they_stand_for(piece, byte_level, fallback, expected):
    assert piece_bytes(piece, byte_level, fallback) == expected


def test_intersection_is_one_to_one_and_matches_across_spellings():
    m = build_vocab_map(byte_level(), sentencepiece(), len(BYTE_LEVEL), len(SENTENCEPIECE))
    pairs = dict(zip(m.draft_ids.tolist(), m.target_ids.tolist()))
    # draft (sentencepiece) id -> target (byte-level) id
    assert pairs == {
        # the special '<|im_end|>' meets the special, not the literal text '<|im_end|>x' or anything else
        2: 0,
        # 'a' wins over the byte-fallback '<0x61>' for b"a"
        5: 1,
        8: 2,
        6: 3,
        7: 4,
        # the byte 0xE2: byte-fallback piece meets GPT-2's single-byte token
        4: 5,
        # '▁' (a normal piece) wins over '<0x20>' for b" "
        9: 6,
    }
    # '<s>' is special in the draft but plain text in the target: no match
    assert 1 not in pairs and 7 not in pairs.values()
    assert m.draft_mask.tolist() == [i in pairs for i in range(len(SENTENCEPIECE))]
    assert m.draft_to_target.tolist() == [pairs.get(i, -1) for i in range(len(SENTENCEPIECE))]
    assert m.size == 7


def test_the_map_works_both_ways_round():
    forward = build_vocab_map(byte_level(), sentencepiece(), len(BYTE_LEVEL), len(SENTENCEPIECE))
    backward = build_vocab_map(sentencepiece(), byte_level(), len(SENTENCEPIECE), len(BYTE_LEVEL))
    there = dict(zip(forward.draft_ids.tolist(), forward.target_ids.tolist()))
    back = dict(zip(backward.target_ids.tolist(), backward.draft_ids.tolist()))
    assert there == back


def test_ids_past_the_model_rows_are_left_out():
    # the draft model has 6 rows: ids 6.. ('▁the', 'é', 'b', '▁', ...) cannot be proposed
    m = build_vocab_map(byte_level(), sentencepiece(), len(BYTE_LEVEL), 6)
    assert sorted(m.draft_ids.tolist()) == [2, 4, 5]
    assert m.draft_mask.shape == (6,)
    # a target model of 4 rows: only target ids 0..3 can be proposed to it
    m = build_vocab_map(byte_level(), sentencepiece(), 4, len(SENTENCEPIECE))
    assert sorted(m.target_ids.tolist()) == [0, 1, 2, 3]


def test_no_shared_token_is_an_error():
    a = vocab_keys(["x", "y"])
    b = vocab_keys(["p", "q"])
    with pytest.raises(ValueError, match="share no token"):
        build_vocab_map(a, b, 2, 2)


def test_target_tokens_are_translated_into_the_drafts_spelling():
    m = build_vocab_map(byte_level(), sentencepiece(), len(BYTE_LEVEL), len(SENTENCEPIECE))
    # 'Ġthe' is one draft token; 'ab' and 'Ġcat' are split over the draft's longest keys; 'c' and 't' are in
    # no draft key and become '<unk>'; the target's special '<|im_end|>' is the draft's special
    assert m.translate(3) == (6,)
    assert m.translate(8) == (5, 8)
    assert m.translate(9) == (9, 0, 5, 0)
    assert m.translate(0) == (2,)
    # the target's plain text '<s>' is spelled with the draft's pieces, never its special '<s>'
    assert 1 not in m.translate(7)
    # the draft's BOS (its tokenizer adds one) opens the context, once
    assert m.translate_ids([3, 1], first=True) == [1, 6, 5]
    assert m.translate_ids([3, 1]) == [6, 5]
    # an id with no token translates to nothing
    assert m.translate(len(BYTE_LEVEL) + 5) == ()


def test_a_special_token_without_counterpart_translates_to_nothing():
    m = build_vocab_map(sentencepiece(), byte_level(), len(SENTENCEPIECE), len(BYTE_LEVEL))
    # '<unk>' and '<s>' are special in the target and absent from the draft's specials
    assert m.translate(0) == () and m.translate(1) == ()
    # the draft (byte-level) has no unk: an unknown byte is dropped; 'é' is one draft token
    assert m.translate(7) == (4,)


def test_logits_masked_to_the_intersection_and_q_carried_to_target_ids():
    m = build_vocab_map(byte_level(), sentencepiece(), len(BYTE_LEVEL), len(SENTENCEPIECE))
    logits = torch.randn(3, len(SENTENCEPIECE), generator=torch.Generator().manual_seed(0))
    # [3, Vd]
    q = m.mask_logits(logits).softmax(-1)
    assert (q[:, ~m.draft_mask] == 0).all()
    # [3, Vt]
    qt = m.target_probs(q)
    assert qt.shape == (3, len(BYTE_LEVEL))
    torch.testing.assert_close(qt.sum(-1), torch.ones(3))
    for d, t in zip(m.draft_ids.tolist(), m.target_ids.tolist()):
        assert torch.equal(qt[:, t], q[:, d])
    unreachable = [t for t in range(len(BYTE_LEVEL)) if t not in m.target_ids.tolist()]
    assert (qt[:, unreachable] == 0).all()
    assert m.to_target(m.draft_ids).tolist() == m.target_ids.tolist()


@pytest.fixture(scope="module")
def tiny_tokenizers(tmp_path_factory):
    """The tiny byte-level tokenizer and the tiny SentencePiece-style one, as verispec Tokenizers."""
    a, b = tmp_path_factory.mktemp("bl"), tmp_path_factory.mktemp("sp")
    build_tokenizer(a)
    build_sp_tokenizer(b, 512)
    return Tokenizer.from_hf_dir(a), Tokenizer.from_hf_dir(b)


def test_real_tokenizers_are_read_by_their_decoder(tiny_tokenizers):
    bl, sp = tiny_tokenizers
    kb, ks = tokenizer_keys(bl), tokenizer_keys(sp)
    assert kb.keys[bl.token_to_id("<|im_end|>")] == "<|im_end|>"
    assert kb.keys[bl.token_to_id("Ġthe")] == b" the"
    assert ks.keys[sp.token_to_id("▁the")] == b" the"
    assert ks.keys[sp.token_to_id("<0xE2>")] == b"\xe2" and ks.fallback[sp.token_to_id("<0xE2>")]
    assert ks.bos == sp.token_to_id("<s>") and ks.unk == sp.token_to_id("<unk>") and kb.bos is None


@pytest.mark.parametrize(
    "text", ["The quick brown fox jumps over the lazy dog.", "héllo wörld — ✓ 你好 🙂 Ω"]
)
@pytest.mark.parametrize("direction", ["bl->sp", "sp->bl"])
def test_translated_context_spells_the_same_text(tiny_tokenizers, text, direction):
    """Every target token of a text, translated one by one, decodes in the draft's tokenizer to the same text: the
    draft reads what the target wrote. (A SentencePiece target's dummy prefix, the '▁' its tokenizer puts before
    the first word, reaches a byte-level draft as the space it spells.)"""
    target, draft = tiny_tokenizers if direction == "bl->sp" else tiny_tokenizers[::-1]
    m = build_vocab_map(tokenizer_keys(target), tokenizer_keys(draft), target.vocab_size, draft.vocab_size)
    ids = target.encode(text, add_special_tokens=False)
    translated = m.translate_ids(ids, first=True)
    assert target.decode(ids) == text
    assert draft.decode(translated) == (" " + text if direction == "sp->bl" else text)
    # the draft's BOS opens it when the draft's tokenizer adds one
    assert (translated[0] == draft.bos_token_id) == draft.add_bos_token
    # the shared tokens: the common text of the two vocabularies, a part of each
    assert 0 < m.size < min(target.vocab_size, draft.vocab_size)
