import pytest

from verispec.planner.fixed import fit_budget


@pytest.mark.parametrize(
    "drafts, allowance, lengths",
    [
        # under budget: untouched
        ([[1, 2, 3], [4]], 10, [3, 1]),
        # shared evenly
        ([[1, 2, 3, 4], [5, 6, 7, 8]], 4, [2, 2]),
        # the short draft's leftover goes to the long one
        ([[1], [2, 3, 4, 5]], 3, [1, 2]),
        ([[1, 2], [3, 4]], 0, [0, 0]),
        ([[1, 2], [3, 4]], -5, [0, 0]),
        ([[], [1, 2, 3]], 2, [0, 2]),
    ],
)
def test_fit_budget(drafts, allowance, lengths):
    out = fit_budget(drafts, allowance)
    assert [len(d) for d in out] == lengths
    # only ever a prefix
    assert all(o == d[: len(o)] for o, d in zip(out, drafts))
