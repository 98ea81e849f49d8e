"""Result objects in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    # "stop" | "length" | "abort"
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SpecDecodeMetrics:
    """One request's speculative decoding, as vLLM's `--per-request-spec-decode-metrics` reports it (its
    `metrics.speculative_decoding` fields), plus per-position counts.

    acceptance_histogram[j]: verify steps that accepted exactly j draft tokens. Position i counts the steps whose
    draft reached i (drafted) and whose accepted prefix covered it (accepted)."""

    num_spec_tokens: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # accepted draft tokens of every verify step, in order
    per_step_accepted: list[int] = field(default_factory=list)

    @classmethod
    def from_steps(
        cls, steps: list[tuple[int, int]], num_spec_tokens: int, num_draft_tokens: int
    ) -> SpecDecodeMetrics:
        """steps: (draft depth, accepted) per verify step; num_draft_tokens: the tokens drafted (a tree drafts
        more than its depth)."""
        width = max([num_spec_tokens, *(d for d, _ in steps)])
        hist, drafted, accepted = [0] * (width + 1), [0] * width, [0] * width
        for depth, n in steps:
            hist[n] += 1
            for i in range(depth):
                drafted[i] += 1
            for i in range(n):
                accepted[i] += 1
        return cls(
            num_spec_tokens,
            num_draft_tokens,
            sum(n for _, n in steps),
            len(steps),
            hist,
            drafted,
            accepted,
            [n for _, n in steps],
        )

    @classmethod
    def combine(cls, parts: list[SpecDecodeMetrics]) -> SpecDecodeMetrics:
        """Several requests' metrics as one (the choices of one HTTP request)."""
        width = max(len(p.num_draft_tokens_per_pos) for p in parts)

        def total(name: str, n: int) -> list[int]:
            return [sum(getattr(p, name)[i] for p in parts if i < len(getattr(p, name))) for i in range(n)]

        return cls(
            max(p.num_spec_tokens for p in parts),
            sum(p.num_draft_tokens for p in parts),
            sum(p.num_accepted_tokens for p in parts),
            sum(p.num_spec_steps for p in parts),
            total("acceptance_histogram", width + 1),
            total("num_draft_tokens_per_pos", width),
            total("num_accepted_tokens_per_pos", width),
            [n for p in parts for n in p.per_step_accepted],
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: 1 (the target's own token) + accepted drafts per step."""
        return 1.0 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)
        ]

    def to_json(self, detailed: bool = False) -> dict:
        """vLLM's `speculative_decoding` object (per_step_accepted with detailed), plus the per-position fields."""
        out = {
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_histogram": self.acceptance_histogram,
            "num_spec_steps": self.num_spec_steps,
            "num_accepted_draft_tokens": self.num_accepted_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "num_spec_tokens": self.num_spec_tokens,
            "num_draft_tokens_per_pos": self.num_draft_tokens_per_pos,
            "num_accepted_tokens_per_pos": self.num_accepted_tokens_per_pos,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
        }
        if detailed:
            out["per_step_accepted"] = self.per_step_accepted
        return out


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # speculative tokens proposed for this request
    num_draft_tokens: int = 0
    # of which accepted by the target
    num_accepted_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = (
        # SamplingParams.prompt_logprobs: one per token
        None
    )
    # extract_hidden_states: {"hidden_states_path": file}
    kv_transfer_params: dict | None = None
    # this request's speculation, on its finished output (None without a speculative method)
    spec_decode_metrics: SpecDecodeMetrics | None = None
