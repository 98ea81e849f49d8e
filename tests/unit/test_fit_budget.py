import pytest

from verispec.engine.engine import fit_budget


@pytest.mark.parametrize(
    "drafts, allowance, lengths",
    [
        ([[1, 2, 3], [4]], 10, [3, 1]),  # under budget: untouched
        ([[1, 2, 3, 4], [5, 6, 7, 8]], 4, [2, 2]),  # shared evenly
        ([[1], [2, 3, 4, 5]], 3, [1, 2]),  # the short draft's leftover goes to the long one
        ([[1, 2], [3, 4]], 0, [0, 0]),
        ([[1, 2], [3, 4]], -5, [0, 0]),
        ([[], [1, 2, 3]], 2, [0, 2]),
    ],
)
def test_fit_budget(drafts, allowance, lengths):
    out = fit_budget(drafts, allowance)
    assert [len(d) for d in out] == lengths
    assert all(o == d[: len(o)] for o, d in zip(out, drafts))  # only ever a prefix
