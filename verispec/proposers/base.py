"""The one contract every speculative method implements; the engine never looks at a method's name.

A proposer declares what it needs from the engine in a `ProposerNeeds`; the engine reads that declaration, and the
factory (proposers/factory.py) is the only place that maps a method name to a proposer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

if TYPE_CHECKING:
    from verispec.request import Request
    from verispec.sample.tree import TokenTree, TreeBatch


@dataclass(frozen=True)
class ProposerNeeds:
    """What a proposer needs from the engine.

    target_hidden: the target's states the proposer drafts from, handed over after every forward by
    observe_hidden: "none"; "last", the state behind each request's newest token (Medusa, MLP speculator); "all",
    the states of every position the forward committed (EAGLE: prompt chunks, accepted drafts).
    aux_layers: target layers whose input streams the proposer reads instead of the final normed state (EAGLE-3,
    extract_hidden_states); id i is the input of layer i.
    observes_states: after every forward the engine calls observe_states with the aux_layers' states of every token
    each request fed to the target in it (extract_hidden_states).
    runs_forward: drafting runs a model forward of its own (draft model, EAGLE, heads), a cost the planner counts.
    """

    target_hidden: Literal["none", "last", "all"] = "none"
    aux_layers: tuple[int, ...] = ()
    observes_states: bool = False
    runs_forward: bool = False


@dataclass
class DraftContext:
    """What a proposer may need from the target side to build itself (a `custom_class` proposer is built as
    cls(config, context) with it)."""

    # verispec.loader.checkpoint.Checkpoint: .model (the target DecoderLM), .config, .tokenizer, .source
    target: object
    # KV-cache slots (the most requests running at once) and positions allocated per slot
    num_slots: int
    t_alloc: int
    device: torch.device
    dtype: torch.dtype
    seed: int
    # extract_hidden_states' connector settings
    kv_transfer_config: dict | None = None
    # the target's paged KV cache (verispec.runner.kv_cache.KVCache): a draft model pages its own cache through the
    # target's block table (None: a drafter holds full-length slots)
    target_cache: object = None
    # what the drafters' KV caches store K and V in (the engine's kv_cache_dtype; None: `dtype`)
    kv_dtype: torch.dtype | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


@dataclass
class Proposal:
    # per request 0..k_max[b] drafts (host lists: the runner builds inputs from them)
    token_ids: list[list[int]]
    # [B, K, V] draft distribution for `probabilistic`; None = one-hot at each draft. With a tree: [B, 1 + N, V] the
    # drafter's distribution at each node, which a random request's children were sampled from without replacement
    draft_probs: torch.Tensor | None = None
    # a token tree (a TreeBatch: one per request): token_ids[b] are then the tree's nodes in its order (static
    # trees: breadth-first; dynamic trees: by path confidence), every parent before its children
    tree: TokenTree | TreeBatch | None = None
    # per request and draft, the proposer's own estimate that the draft is accepted if the ones before it were
    # (suffix decoding's frequency ratios; a dynamic tree's node: its draft probability, if its parent was); the
    # planner calibrates it. None: no estimate
    confidence: list[list[float]] | None = None
    # per request, (token, confidence): a drafter's greedy pick for the request's newest committed token from the
    # context before it, read off its catch-up forward (None: not made); the planner judges it in hindsight
    hindsight: list[tuple[int, float] | None] | None = None


class Proposer(Protocol):
    needs: ProposerNeeds

    def add_request(self, req: Request) -> None: ...

    def remove_request(self, req: Request, aborted: bool) -> None: ...

    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        """Drafts for each request's next step (after its newest committed token), at most k_max[b] each."""
        ...

    def backlog(self, req: Request) -> int:
        """Only called when needs.runs_forward: the positions the drafter reads before it drafts for req (its
        catch-up on the tokens committed since it last drafted for it; the prompt at first). The planner prices a
        draft for a request that has been idle with it."""
        ...

    def observe_hidden(self, reqs: list[Request], hidden: list[torch.Tensor]) -> None:
        """Only called when needs.target_hidden is not "none": hidden[b] [n_b, H], the rows of the positions ending
        at reqs[b].num_computed (exclusive), in order; its last row produced the newest token."""
        ...

    def observe_states(
        self, reqs: list[Request], token_ids: list[list[int]], states: list[torch.Tensor]
    ) -> None:
        """Only called when needs.observes_states: states[b] [len(token_ids[b]), len(aux_layers), H] (aux_layers
        order); called before the step's tokens are committed, so a request that finishes in this step is live."""
        ...


def asked(k_max: list[int]) -> list[int] | None:
    """Indices of the requests asked for drafts, or None when every request is: a drafter with a forward of its own
    runs only those (a request it skips keeps its unread target states for its next draft)."""
    rows = [i for i, k in enumerate(k_max) if k > 0]
    return None if len(rows) == len(k_max) else rows


def scatter(sub: Proposal, rows: list[int], n: int) -> Proposal:
    """A chain proposal for the requests at `rows` of a batch of n -> one for the whole batch (no drafts elsewhere)."""
    drafts: list[list[int]] = [[] for _ in range(n)]
    confidence: list[list[float]] = [[] for _ in range(n)]
    for j, i in enumerate(rows):
        drafts[i] = sub.token_ids[j]
        confidence[i] = sub.confidence[j] if sub.confidence is not None else []
    probs = None
    if sub.draft_probs is not None:
        # [n, K, V]
        probs = sub.draft_probs.new_zeros(n, *sub.draft_probs.shape[1:])
        probs[rows] = sub.draft_probs
    hindsight = None
    if sub.hindsight is not None:
        hindsight = [None] * n
        for j, i in enumerate(rows):
            hindsight[i] = sub.hindsight[j]
    return Proposal(
        drafts, probs, confidence=None if sub.confidence is None else confidence, hindsight=hindsight
    )


def argmax_drafts(draft, head_in: torch.Tensor, rows: list[int], counts: list[int]) -> Proposal:
    """A drafter whose drafts are the argmax at given rows of one forward (DFlash's masks, P-EAGLE's rows): head_in
    [N, H], rows the packed indices of every request's logits rows in order, counts[b] of them request b's."""
    idx = torch.tensor(rows, dtype=torch.long, device=head_in.device)
    # [sum counts]: the step's one host sync
    flat = draft.draft_ids(head_in.index_select(0, idx)).tolist()
    out, at = [], 0
    for c in counts:
        out.append(flat[at : at + c])
        at += c
    return Proposal(out)
