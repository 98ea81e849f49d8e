"""Prompt-lookup (n-gram) drafting as pure numpy functions.

Find the longest n in [min_n, max_n] such that the last n tokens of the context also occur
earlier in it (ending before the last position), take the EARLIEST such occurrence and
propose up to k tokens that followed it.

Vectorised: one O(L) comparison of the whole context against its last token yields the
candidate end positions; each longer n only re-checks the surviving candidates (a loop over
n, never over the context).
"""

import numpy as np

# the longest match `match_length` measures: past it a draft is as good as certain to be copied
MATCH_CAP = 64


def ngram_lookup(context: np.ndarray, min_n: int, max_n: int) -> int:
    """End index of the earliest earlier occurrence of the context's longest matching suffix (n in [min_n, max_n]),
    -1 if there is none."""
    if min_n < 1 or max_n < min_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
    context = np.asarray(context)
    L = context.shape[0]
    if L < min_n + 1:
        return -1
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
    return best


def match_length(context: np.ndarray, end: int, cap: int = MATCH_CAP) -> int:
    """How many tokens the context's suffix and the tokens ending at index `end` share, counted backwards (at most
    cap): at least the n the lookup matched, more when the match runs on past max_n (a span being copied)."""
    context = np.asarray(context)
    n = min(cap, end + 1)
    L = context.shape[0]
    # [n] both spans, newest token first
    earlier = context[end - n + 1 : end + 1][::-1]
    latest = context[L - n :][::-1]
    differ = np.flatnonzero(earlier != latest)
    return int(differ[0]) if differ.size else n


def match_confidence(length: int, k: int) -> list[float]:
    """A score per draft of a match `length` tokens long, increasing with the match: draft i continues a match of
    length + i tokens if the drafts before it were accepted. Not a probability: the planner calibrates it."""
    return [(length + i) / (length + i + 2) for i in range(k)]


def ngram_propose(context: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Return up to ``k`` proposed tokens (1-D, context dtype; empty if no match)."""
    context = np.asarray(context)
    best = ngram_lookup(context, min_n, max_n)
    if k <= 0 or best < 0:
        return context[:0].copy()
    return context[best + 1 : best + 1 + k].copy()
