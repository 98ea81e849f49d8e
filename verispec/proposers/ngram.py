"""`ngram` (prompt lookup): drafts are the tokens that followed the longest earlier match of the context's suffix.

Each draft carries a confidence from the match's length (measured back past max_n): a suffix that matches the
earlier text for dozens of tokens is a span being copied, whose drafts are accepted far more often than those of a
bare max_n-token match. The planner calibrates it and verifies more drafts of long matches.

Prompt-lookup (n-gram) drafting as pure functions over token lists.

Find the longest n in [min_n, max_n] such that the last n tokens of the context also occur earlier in it (ending
before the last position), take the EARLIEST such occurrence and propose up to k tokens that followed it.

`NgramIndex` keeps, for every n in [min_n, max_n], the first end position of each n-gram of a growing context, so
that a step's lookup is one dict probe per n and a committed token costs one insert per n: a request's drafting
time does not grow with its context."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from verispec.proposers.base import Proposal, ProposerNeeds
from verispec.request import Request

# the longest match `match_length` measures: past it a draft is as good as certain to be copied
MATCH_CAP = 64


class NgramIndex:
    """The earliest end index of every n-gram (min_n <= n <= max_n) of a token sequence that grows at its end.

    An n-gram is indexed once the token after it arrives, so a lookup never finds the context's own suffix."""

    def __init__(self, min_n: int, max_n: int):
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # first[n - min_n]: n-gram -> end index of its earliest occurrence
        self.first: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks = self.tokens
        for t in tokens:
            # the n-grams ending at the current last token are followed by t now
            end = len(toks) - 1
            for n, first in enumerate(self.first, start=self.min_n):
                if end + 1 < n:
                    break
                first.setdefault(tuple(toks[end + 1 - n : end + 1]), end)
            toks.append(int(t))

    def lookup(self) -> int:
        """End index of the earliest earlier occurrence of the context's longest matching suffix, -1 if none."""
        toks, size = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = self.first[n - self.min_n].get(tuple(toks[size - n :]))
            if end is not None:
                return end
        return -1


def ngram_lookup(context: Sequence[int], min_n: int, max_n: int) -> int:
    """End index of the earliest earlier occurrence of the context's longest matching suffix (n in [min_n, max_n]),
    -1 if there is none."""
    index = NgramIndex(min_n, max_n)
    index.extend(context)
    return index.lookup()


def match_length(context: Sequence[int], end: int, cap: int = MATCH_CAP) -> int:
    """How many tokens the context's suffix and the tokens ending at index `end` share, counted backwards (at most
    cap): at least the n the lookup matched, more when the match runs on past max_n (a span being copied)."""
    last = len(context) - 1
    n = min(cap, end + 1)
    for i in range(n):
        if context[end - i] != context[last - i]:
            return i
    return n


def match_confidence(length: int, k: int) -> list[float]:
    """A score per draft of a match `length` tokens long, increasing with the match: draft i continues a match of
    length + i tokens if the drafts before it were accepted. Not a probability: the planner calibrates it."""
    return [(length + i) / (length + i + 2) for i in range(k)]


def ngram_propose(context: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` proposed tokens (empty if no match)."""
    context = [int(t) for t in context]
    best = ngram_lookup(context, min_n, max_n)
    if k <= 0 or best < 0:
        return []
    return context[best + 1 : best + 1 + k]


class NgramProposer:
    needs = ProposerNeeds()

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        # per request, the n-gram index of its committed tokens (built at its first draft, extended at each next)
        self._index: dict[str, NgramIndex] = {}

    def add_request(self, req: Request) -> None:
        self._index[req.request_id] = NgramIndex(self.min_n, self.max_n)

    def remove_request(self, req: Request, aborted: bool) -> None:
        self._index.pop(req.request_id, None)

    def _context(self, req: Request) -> NgramIndex:
        index = self._index[req.request_id]
        n = len(index)
        # the prompt, then the output tokens committed since the last draft
        if n < req.num_prompt:
            index.extend(req.prompt_token_ids[n:])
            n = req.num_prompt
        if req.num_tokens > n:
            index.extend(req.output_token_ids[n - req.num_prompt :])
        return index

    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        drafts, confidence = [], []
        for r, k in zip(reqs, k_max):
            index = self._context(r) if k > 0 else None
            end = -1 if index is None else index.lookup()
            if end < 0:
                drafts.append([])
                confidence.append([])
                continue
            ctx = index.tokens
            draft = ctx[end + 1 : end + 1 + k]
            drafts.append(draft)
            confidence.append(match_confidence(match_length(ctx, end), len(draft)))
        return Proposal(drafts, confidence=confidence)
