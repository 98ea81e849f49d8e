"""The one protocol every speculative method implements; the engine never looks at a method's name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from verispec.engine.model_runner import RunnerOutput
    from verispec.engine.request import Request


@dataclass
class Proposal:
    token_ids: list[
        list[int]
    ]  # per request, 0..k_max[b] drafts (host lists: the runner builds inputs from them)
    draft_probs: torch.Tensor | None = (
        None  # [B, K, V] draft distribution for `probabilistic`; None = one-hot
    )


class Proposer(Protocol):
    aux_layers: tuple[int, ...]  # target layers whose hidden states the proposer needs (EAGLE-3), else ()
    # True: after every step the engine calls observe_hidden(reqs, hidden [B, H]) with the target's final normed
    # hidden state at the position whose logits gave each request's newest token (Medusa)
    needs_last_hidden: bool
    # True: after every forward the engine calls observe_states with the aux_layers' states of every token each
    # request fed to the target in it (extract_hidden_states)
    observes_states: bool

    def add_request(self, req: Request) -> None: ...

    def remove_request(self, req: Request, aborted: bool) -> None: ...

    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        """Drafts for each request's next step (after its newest committed token), at most k_max[b] each."""
        ...

    def observe_hidden(self, reqs: list[Request], hidden: torch.Tensor) -> None:
        """Only called when needs_last_hidden."""
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
