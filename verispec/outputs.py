"""Result objects in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# --per-request-spec-decode-metrics (vLLM's values): none collects nothing, summary the counts and histograms,
# detailed also the per-step arrays
SPEC_METRICS_LEVELS = ("none", "summary", "detailed")


@dataclass
class SpecDecodeMetrics:
    """One request's speculative decoding, as vLLM's `--per-request-spec-decode-metrics` reports it (its
    `metrics.speculative_decoding` object, `to_json`), plus per-position counts.

    acceptance_histogram[j]: verify steps that accepted exactly j draft tokens (dense, K + 1 entries; a token tree
    deeper than K widens it). acceptance_histogram_by_draft_length[k][j]: of the steps that drafted k tokens, those
    that accepted j. Position i counts the steps whose draft reached i (drafted) and whose accepted prefix covered
    it (accepted). per_step_accepted / per_step_drafted: every verify step in order, kept with `detailed` only."""

    num_spec_tokens: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)
    acceptance_histogram_by_draft_length: dict[int, list[int]] = field(default_factory=dict)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # the per-step arrays were kept (--per-request-spec-decode-metrics detailed)
    detailed: bool = False
    per_step_accepted: list[int] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)

    @classmethod
    def from_steps(
        cls, steps: list[tuple[int, int, int]], num_spec_tokens: int, detailed: bool = False
    ) -> SpecDecodeMetrics:
        """steps: (draft depth, tokens drafted, accepted) per verify step; a chain drafts its depth, a tree more."""
        width = max([num_spec_tokens, *(d for d, _, _ in steps)])
        hist, drafted, accepted = [0] * (width + 1), [0] * width, [0] * width
        by_length: dict[int, list[int]] = {}
        for depth, k, n in steps:
            hist[n] += 1
            by_length.setdefault(k, [0] * (k + 1))[n] += 1
            for i in range(depth):
                drafted[i] += 1
            for i in range(n):
                accepted[i] += 1
        return cls(
            num_spec_tokens,
            sum(k for _, k, _ in steps),
            sum(n for _, _, n in steps),
            len(steps),
            hist,
            dict(sorted(by_length.items())),
            drafted,
            accepted,
            detailed,
            [n for _, _, n in steps] if detailed else [],
            [k for _, k, _ in steps] if detailed else [],
        )

    @classmethod
    def combine(cls, parts: list[SpecDecodeMetrics]) -> SpecDecodeMetrics:
        """Several requests' metrics as one (the n samples of one prompt)."""
        width = max(len(p.num_draft_tokens_per_pos) for p in parts)

        def total(name: str, n: int) -> list[int]:
            return [sum(getattr(p, name)[i] for p in parts if i < len(getattr(p, name))) for i in range(n)]

        by_length: dict[int, list[int]] = {}
        for p in parts:
            for k, row in p.acceptance_histogram_by_draft_length.items():
                by_length[k] = [a + b for a, b in zip(by_length.get(k, [0] * (k + 1)), row)]
        # the steps in order, one part after the other (only when every part kept them)
        detailed = all(p.detailed for p in parts)
        return cls(
            max(p.num_spec_tokens for p in parts),
            sum(p.num_draft_tokens for p in parts),
            sum(p.num_accepted_tokens for p in parts),
            sum(p.num_spec_steps for p in parts),
            total("acceptance_histogram", width + 1),
            dict(sorted(by_length.items())),
            total("num_draft_tokens_per_pos", width),
            total("num_accepted_tokens_per_pos", width),
            detailed,
            [n for p in parts for n in p.per_step_accepted] if detailed else [],
            [k for p in parts for k in p.per_step_drafted] if detailed else [],
        )

    @property
    def histogram(self) -> list[int]:
        """vLLM's name for the acceptance histogram on its offline object."""
        return self.acceptance_histogram

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

    def to_json(self) -> dict:
        """vLLM's `speculative_decoding` object (the per-step arrays when detailed; JSON keys are strings), plus
        the per-position fields."""
        out = {
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_histogram": self.acceptance_histogram,
            "acceptance_histogram_by_draft_length": {
                str(k): row for k, row in self.acceptance_histogram_by_draft_length.items()
            },
            "num_spec_steps": self.num_spec_steps,
            "num_accepted_draft_tokens": self.num_accepted_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "num_spec_tokens": self.num_spec_tokens,
            "num_draft_tokens_per_pos": self.num_draft_tokens_per_pos,
            "num_accepted_tokens_per_pos": self.num_accepted_tokens_per_pos,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
        }
        if self.detailed:
            out["per_step_accepted"] = self.per_step_accepted
            out["per_step_drafted"] = self.per_step_drafted
        return out

    # vLLM's name for the same payload
    to_dict = to_json


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
    # this sample's speculation, where vLLM puts it: on the finished output, with
    # per_request_spec_decode_metrics summary / detailed and a speculative method (else None)
    spec_decode_metrics: SpecDecodeMetrics | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


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
    # the speculation of its samples (outputs[j].spec_decode_metrics; several samples summed): on the finished
    # output, with per_request_spec_decode_metrics summary / detailed and a speculative method (else None)
    spec_decode_metrics: SpecDecodeMetrics | None = None
