"""What the engine hands the sampler for one step (the drafts to verify and how to verify them) and what it gets
back (the tokens to commit)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.sample.logits import Logprobs
from verispec.sample.tree import TreeBatch


@dataclass(frozen=True)
class VerifyRule:
    """How the drafts of random (temperature > 0) rows are judged, chosen once from the speculative config.
    Greedy rows always accept while draft == target argmax.

    method: "strict" (the target's own sample at every position), "probabilistic" (Leviathan / Chen rejection
    sampling against the draft probabilities) or "synthetic" (a fixed acceptance rate, for benchmarking).
    block: Block Verify on steps with at least 3 drafts (probabilistic only).
    entropy: (posterior_threshold, posterior_alpha) of Entropy Verify (probabilistic only; lossy by design).
    """

    method: str = "strict"
    synthetic_acceptance_rate: float | None = None
    block: bool = False
    entropy: tuple[float, float] | None = None

    @classmethod
    def from_config(cls, spec) -> VerifyRule:
        """The rule of a resolved SpeculativeConfig (None: plain decoding, strict)."""
        if spec is None:
            return cls()
        entropy = (spec.posterior_threshold, spec.posterior_alpha) if spec.enable_entropy_verify else None
        return cls(
            spec.rejection_sample_method,
            spec.synthetic_acceptance_rate,
            bool(spec.enable_block_verify),
            entropy,
        )

    @property
    def next_token_judges(self) -> bool:
        """Whether a one-hot draft is accepted exactly when (strict; greedy rows) or as often as (probabilistic:
        with probability p(draft)) the target's next token equals it: then drafts that were not verified can be
        judged against the tokens committed instead. Not under the synthetic rate, Block Verify or Entropy Verify."""
        return self.method in ("strict", "probabilistic") and not self.block and self.entropy is None

    @property
    def lossy_reason(self) -> str | None:
        """Why random rows' output law is not the target's by design, or None (every other rule is lossless):
        the synthetic rate accepts drafts whatever the target says, Entropy Verify relaxes the acceptance test."""
        if self.method == "synthetic":
            rate = self.synthetic_acceptance_rate
            return f"rejection_sample_method 'synthetic' accepts drafts at a set rate ({rate})"
        if self.entropy is not None:
            return "enable_entropy_verify relaxes the acceptance test"
        return None

    @property
    def draws_uniform(self) -> bool:
        """Whether random rows need U[0, 1) acceptance samples (every rule but strict)."""
        return self.method != "strict"


@dataclass
class SpecDecodeMetadata:
    """The drafts of one step, one entry per request in batch order. Plain decoding: every list empty."""

    # per request 0..K draft token ids
    draft_token_ids: list[list[int]]
    # [B, K, V] the drafter's distribution at each draft; None: one-hot at the draft (draft-free proposers).
    # With a tree: [B, 1 + N, V] at each node, its children's law
    draft_probs: torch.Tensor | None = None
    # a token tree per request: draft_token_ids[b] are its N nodes breadth-first; None: chains
    tree: TreeBatch | None = None

    @classmethod
    def none(cls, batch: int) -> SpecDecodeMetadata:
        return cls([[] for _ in range(batch)])

    @property
    def max_drafts(self) -> int:
        return max((len(d) for d in self.draft_token_ids), default=0)


@dataclass
class StepTokens:
    """What one step emits, per request in batch order."""

    # accepted drafts then one recovered / bonus token
    tokens: list[list[int]]
    num_accepted: list[int]
    # per scored row (flattened [B * (K + 1)]) when any request asked for logprobs
    logprobs: Logprobs | None
    # K + 1 (a tree: 1 + N)
    row_stride: int
    # a tree step: per request, whether each of its 1 + N nodes is on the accepted path (the root always is)
    on_path: list[list[bool]] | None = None

    def accepted_nodes(self, b: int) -> list[int]:
        """A tree step's accepted nodes of request b (1..N, breadth-first = increasing depth)."""
        return [j for j, on in enumerate(self.on_path[b]) if on and j]
