import numpy as np
import pytest

from verispec.proposers.ngram import (
    NgramIndex,
    NgramProposer,
    match_confidence,
    match_length,
    ngram_lookup,
    ngram_propose,
)
from verispec.request import Request
from verispec.sampling_params import SamplingParams


def _ref_end(context: list[int], min_n: int, max_n: int) -> int:
    """Brute force: the end index of the earliest occurrence of the longest suffix n-gram, ending before the last
    position; -1 if none."""
    L = len(context)
    for n in range(max_n, min_n - 1, -1):
        if n > L - 1:
            continue
        suffix = context[L - n :]
        # occurrence [i, i+n) ends at i+n-1 <= L-2
        for i in range(L - n):
            if context[i : i + n] == suffix:
                return i + n - 1
    return -1


def _ref(context: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    end = _ref_end(context, min_n, max_n)
    return [] if end < 0 else context[end + 1 : end + 1 + k]


@pytest.mark.parametrize(
    "context,min_n,max_n,k,expected",
    [
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
        # fewer than k: the context ends
        ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),
        # no earlier [5, 6]
        ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
        # longest n = 3 wins
        ([1, 2, 3, 4, 1, 2, 3], 1, 3, 2, [4, 1]),
        # tie on n: earliest occurrence
        ([9, 1, 7, 1, 8, 1], 1, 1, 1, [7]),
        # occurrence overlapping the suffix; 1 token left
        ([5, 5, 5, 5], 1, 3, 2, [5]),
        # n = 4 absent, n = 3 found
        ([1, 2, 3, 1, 2, 3], 1, 4, 2, [1, 2]),
        ([1, 2, 3], 1, 2, 3, []),
        ([4], 1, 1, 3, []),
        ([], 1, 1, 3, []),
        # k = 0
        ([1, 2, 1, 2], 2, 2, 0, []),
        # n too long for the context
        ([1, 2, 1], 3, 5, 2, []),
    ],
)
def test_table(context, min_n, max_n, k, expected):
    assert ngram_propose(context, min_n, max_n, k) == expected == _ref(context, min_n, max_n, k)


def test_matches_brute_force_on_random_contexts():
    rng = np.random.default_rng(0)
    for _ in range(500):
        L = int(rng.integers(1, 60))
        context = rng.integers(0, int(rng.integers(2, 6)), L)
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(0, 6))
        assert ngram_propose(context, min_n, max_n, k) == _ref(context.tolist(), min_n, max_n, k)


def test_index_grown_in_pieces_matches_brute_force_at_every_length():
    """The engine extends a request's index by the tokens each step commits (one or several at a time); at every
    length its lookup is the brute-force answer on the tokens so far."""
    rng = np.random.default_rng(2)
    for _ in range(100):
        tokens = rng.integers(0, int(rng.integers(2, 5)), int(rng.integers(1, 80))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        index, at = NgramIndex(min_n, max_n), 0
        while at < len(tokens):
            step = int(rng.integers(1, 5))
            index.extend(tokens[at : at + step])
            at = min(len(tokens), at + step)
            assert index.lookup() == _ref_end(tokens[:at], min_n, max_n)


def test_bad_n_range():
    with pytest.raises(ValueError):
        ngram_propose([1, 2], 0, 2, 1)
    with pytest.raises(ValueError):
        ngram_propose([1, 2], 3, 2, 1)


def _ref_match_length(context: list[int], end: int, cap: int) -> int:
    n = 0
    while n < cap and end - n >= 0 and context[end - n] == context[len(context) - 1 - n]:
        n += 1
    return n


def test_match_length_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(500):
        context = rng.integers(0, int(rng.integers(2, 4)), int(rng.integers(2, 80)))
        end = ngram_lookup(context, 1, 3)
        if end < 0:
            continue
        cap = int(rng.integers(1, 40))
        assert match_length(context, end, cap) == _ref_match_length(context.tolist(), end, cap)


def test_match_length_runs_past_max_n():
    # the suffix [1..6] was seen before: the lookup matches 2 tokens, the match is 6 long
    context = np.array([9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6])
    end = ngram_lookup(context, 2, 2)
    assert context[end + 1] == 7
    assert match_length(context, end) == 6
    assert match_length(context, end, cap=4) == 4


def test_match_confidence_grows_with_the_match():
    short, long = match_confidence(4, 3), match_confidence(32, 3)
    assert len(short) == 3 and short == sorted(short)
    assert all(0 < c < 1 for c in short + long)
    assert short[0] < long[0]
    assert match_confidence(4, 0) == []


def test_proposer_drafts_and_scores_by_match_length():
    """The proposer drafts what ngram_propose gives on the committed tokens (prompt + outputs, appended as they
    come), each draft scored by the match it continues."""
    prompt = [9, 1, 2, 3, 4, 5, 6, 7, 8, 0]
    req = Request("r", None, prompt, SamplingParams(temperature=0))
    prop = NgramProposer(2, 2)
    prop.add_request(req)
    # no earlier [8, 0]: nothing to draft
    assert prop.propose([req], [3]).token_ids == [[]]
    req.output_token_ids += [1, 2, 3, 4, 5, 6]
    out = prop.propose([req], [3])
    ctx = np.array(prompt + req.output_token_ids)
    assert out.token_ids == [ngram_propose(ctx, 2, 2, 3)] == [[7, 8, 0]]
    assert out.confidence == [match_confidence(6, 3)]
    # asked for nothing: no drafts, no lookup
    assert prop.propose([req], [0]).token_ids == [[]]
