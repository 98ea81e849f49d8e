"""The one protocol every speculative method implements; the engine never looks at a method's name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from verispec.engine.model_runner import RunnerOutput
    from verispec.engine.request import Request
    from verispec.spec.tree import TokenTree


@dataclass
class Proposal:
    token_ids: list[
        list[int]
    ]  # per request, 0..k_max[b] drafts (host lists: the runner builds inputs from them)
    draft_probs: torch.Tensor | None = (
        None  # [B, K, V] draft distribution for `probabilistic`; None = one-hot
    )
    tree: TokenTree | None = None  # token_ids[b] are then the tree's nodes in its (breadth-first) order


class Proposer(Protocol):
    aux_layers: tuple[int, ...]  # target layers whose hidden states the proposer needs (EAGLE-3), else ()
    # The target's final normed hidden states the proposer drafts from, handed over after every forward by
    # observe_hidden: "none"; "last", the state behind each request's newest token (Medusa, MLP speculator); "all",
    # the states of every position the forward committed (EAGLE: prompt chunks, accepted drafts)
    target_hidden: str
    # True: after every forward the engine calls observe_states with the aux_layers' states of every token each
    # request fed to the target in it (extract_hidden_states)
    observes_states: bool

    def add_request(self, req: Request) -> None: ...

    def remove_request(self, req: Request, aborted: bool) -> None: ...

    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        """Drafts for each request's next step (after its newest committed token), at most k_max[b] each."""
        ...

    def observe_hidden(self, reqs: list[Request], hidden: list[torch.Tensor]) -> None:
        """Only called when target_hidden is not "none": hidden[b] [n_b, H], the rows of the positions ending at
        reqs[b].num_computed (exclusive), in order; its last row produced the newest token."""
        ...

    def observe_states(
        self, reqs: list[Request], token_ids: list[list[int]], states: list[torch.Tensor]
    ) -> None:
        """Only called when observes_states: states[b] [len(token_ids[b]), len(aux_layers), H] (aux_layers order);
        called before the step's tokens are committed, so a request that finishes in this step is still live."""
        ...

    def on_step_end(self, reqs: list[Request], target: RunnerOutput, num_accepted: list[int]) -> None:
        """Called after verification; target holds logits/hidden states of every scored position."""
        ...
