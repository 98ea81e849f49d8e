"""Fixed K (`enable_adaptive_verification: false`, vLLM's behaviour): every request verifies what it drafted, up to
the cap, trimmed so that a step scores at most `spec_token_budget` rows. It has the goodput planner's interface
(planner/goodput.py), so the engine's step never asks which planner it holds; everything it would learn from is
ignored."""

from __future__ import annotations

from collections.abc import Sequence

from verispec.sample.metadata import SpecDecodeMetadata, StepTokens


def fit_budget(drafts: list[list[int]], allowance: int) -> list[list[int]]:
    """Trim drafts so that their total length is at most `allowance`, sharing it evenly (short drafts first)."""
    if sum(len(d) for d in drafts) <= allowance:
        return drafts
    out = list(drafts)
    order = sorted(range(len(drafts)), key=lambda i: len(drafts[i]))
    left = max(0, allowance)
    for n, i in enumerate(order):
        take = min(len(drafts[i]), left // (len(order) - n))
        out[i] = drafts[i][:take]
        left -= take
    return out


class FixedPlanner:
    # the ask needs no drafter backlog, and tokens of a closed batch are not weighed
    reads_backlog = False
    weighs_worth = False

    def __init__(self, spec_token_budget: int):
        self.budget = spec_token_budget

    def skips(self, request_ids: list[str]) -> bool:
        return False

    def ask(self, request_ids: list[str], caps: list[int], batch_rows: int, *args, **kwargs) -> list[int]:
        """Every request is asked for its cap."""
        return caps

    def choose(
        self, request_ids: list[str], drafts: list[list[int]], confidence, batch_rows: int, *args, **kwargs
    ) -> list[int]:
        """Every draft, trimmed to the step's token budget (the batch's own rows first)."""
        return [len(d) for d in fit_budget(drafts, self.budget - batch_rows)]

    def choose_nodes(self, request_ids: list[str], parents: Sequence[Sequence[int]], *args, **kwargs) -> int:
        """Every node of a dynamic tree: more than it has (parents hold the root too), so it is not cut."""
        return max(len(p) for p in parents)

    def observe_draft_time(self, k: int, seconds: float, read: int | None = None) -> None:
        pass

    def observe_verified(
        self,
        request_ids: list[str],
        spec: SpecDecodeMetadata,
        confidence,
        step: StepTokens,
        rows: int,
        seconds: float,
        longest_ask: int,
    ) -> None:
        pass

    def hindsight(self, request_ids: list[str], picks) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass

    def report(self, counters) -> None:
        pass

    def log_line(self) -> str:
        return ""
