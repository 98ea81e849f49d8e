"""bad_words as vLLM defines them: tokenization (with the mid-text ' word' form) and which token is banned next."""

from __future__ import annotations

from verispec.sample.constraints import bad_words_token_ids, banned_by_bad_words


class Tok:
    """A toy tokenizer: a leading space is its own token 1 unless the word is in `fused` (one ' word' token)."""

    vocab = {"a": 10, "b": 11, "c": 12}
    fused = {" a": 20}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text in self.fused:
            return [self.fused[text]]
        ids = [1] if text.startswith(" ") else []
        return ids + [self.vocab[ch] for ch in text.strip()]


def test_tokenization_adds_the_mid_text_form_only_when_it_is_a_different_sequence_of_the_same_length():
    # ' a' is one other token: both forms
    assert bad_words_token_ids(["a"], Tok()) == [[10], [20]]
    # ' bc' is 3 tokens: only the plain form
    assert bad_words_token_ids(["  bc"], Tok()) == [[11, 12]]
    assert bad_words_token_ids(["a", "b"], Tok()) == [[10], [20], [11]]


def test_the_last_token_is_banned_when_the_output_ends_with_the_rest():
    bad = [[10], [11, 12], [5, 6, 7]]
    # single tokens: always
    assert banned_by_bad_words(bad, []) == [10]
    assert banned_by_bad_words(bad, [3, 11]) == [10, 12]
    assert banned_by_bad_words(bad, [11, 3]) == [10]
    # prefix [5, 6] longer than... not matched
    assert banned_by_bad_words(bad, [6]) == [10]
    assert banned_by_bad_words(bad, [5, 6]) == [10, 7]
    assert banned_by_bad_words(bad, [9, 5, 6]) == [10, 7]


def test_verify_positions_see_the_drafts_before_them():
    """At verify position j the output so far includes drafts[:j]: a bad word completed by a draft is banned there."""
    import torch

    from verispec.request import Request
    from verispec.sample.metadata import SpecDecodeMetadata, VerifyRule
    from verispec.sample.step import sample_step
    from verispec.sampling_params import SamplingParams

    r = Request("r", None, [3], SamplingParams(temperature=0, bad_words=["x"]), output_token_ids=[1])
    r.bad_words_token_ids = [[5, 6]]
    # rows: position 0 (last token), after draft 5, after draft 6
    logits = torch.zeros(3, 10)
    # the target's argmax everywhere, unless banned
    logits[:, 6] = 1.0
    step = sample_step([r], logits, SpecDecodeMetadata([[5, 6]]), VerifyRule())
    # position 0 (past [1]) picks 6, so draft 5 is rejected there: 6 is emitted
    assert step.tokens == [[6]]
    r2 = Request("r2", None, [3], SamplingParams(temperature=0, bad_words=["x"]), output_token_ids=[1])
    r2.bad_words_token_ids = [[5, 6]]
    logits = torch.zeros(3, 10)
    # the target agrees with draft 5, then would say 6
    logits[0, 5] = logits[1, 6] = logits[2, 4] = 1.0
    step = sample_step([r2], logits, SpecDecodeMetadata([[5, 6]]), VerifyRule())
    # after draft 5 the bad word [5, 6] bans 6 (the target's choice): draft 6 is rejected, the next best (0) comes
    assert step.tokens == [[5, 0]]
