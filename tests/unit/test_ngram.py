import numpy as np
import pytest

from verispec.spec.ngram import ngram_propose


def _ref(context: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Brute force: longest n, earliest occurrence ending before the last position."""
    L = len(context)
    for n in range(max_n, min_n - 1, -1):
        if n > L - 1:
            continue
        suffix = context[L - n :]
        # occurrence [i, i+n) ends at i+n-1 <= L-2
        for i in range(L - n):
            if context[i : i + n] == suffix:
                return context[i + n : i + n + k]
    return []


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
    out = ngram_propose(np.array(context, dtype=np.int64), min_n, max_n, k)
    assert out.ndim == 1 and out.dtype == np.int64
    assert out.tolist() == expected == _ref(context, min_n, max_n, k)


def test_matches_brute_force_on_random_contexts():
    rng = np.random.default_rng(0)
    for _ in range(500):
        L = int(rng.integers(1, 60))
        context = rng.integers(0, int(rng.integers(2, 6)), L)
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(0, 6))
        assert ngram_propose(context, min_n, max_n, k).tolist() == _ref(context.tolist(), min_n, max_n, k)


def test_result_is_a_copy():
    context = np.array([1, 2, 3, 1, 2])
    out = ngram_propose(context, 1, 2, 2)
    out[:] = -1
    assert context.tolist() == [1, 2, 3, 1, 2]


def test_bad_n_range():
    with pytest.raises(ValueError):
        ngram_propose(np.array([1, 2]), 0, 2, 1)
    with pytest.raises(ValueError):
        ngram_propose(np.array([1, 2]), 3, 2, 1)
