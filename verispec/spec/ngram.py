"""Prompt-lookup (n-gram) drafting as pure numpy functions.

Find the longest n in [min_n, max_n] such that the last n tokens of the context also occur
earlier in it (ending before the last position), take the EARLIEST such occurrence and
propose up to k tokens that followed it.

Vectorised: one O(L) comparison of the whole context against its last token yields the
candidate end positions; each longer n only re-checks the surviving candidates (a loop over
n, never over the context).
"""

import numpy as np


def ngram_propose(context: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Return up to ``k`` proposed tokens (1-D, context dtype; empty if no match)."""
    if min_n < 1 or max_n < min_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
    context = np.asarray(context)
    L = context.shape[0]
    if k <= 0 or L < min_n + 1:
        return context[:0].copy()
    # candidate end indices e <= L-2 (never the suffix itself), ascending = earliest first
    # [M]
    ends = np.flatnonzero(context[:-1] == context[-1])
    # end index of the earliest occurrence of the longest matching n >= min_n
    best = -1
    # ends currently match the last t tokens
    for t in range(1, max_n + 1):
        if ends.size == 0:
            break
        if t >= min_n:
            # earliest; longer n overwrite
            best = int(ends[0])
        if t == max_n:
            break
        # room for one more token before the occurrence
        ends = ends[ends >= t]
        ends = ends[context[ends - t] == context[L - 1 - t]]
    if best < 0:
        return context[:0].copy()
    return context[best + 1 : best + 1 + k].copy()
