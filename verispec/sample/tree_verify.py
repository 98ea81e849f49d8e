"""Lossless verification of a token tree against the drafter's probabilities: recursive rejection sampling.

At a node the target's distribution is p and the drafter's is q. Its children are x_1, x_2, ... in rank order:

- sampled children (random requests under `probabilistic`): x_1 ~ q, x_2 ~ q without x_1 (renormalised), ..., i.e.
  drawn without replacement from q. Child i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), where
  p_1 = p, q_1 = q and after a rejection p_{i+1} = norm(max(0, p_i - q_i)), q_{i+1} = q_i without x_i, renormalised.
  This is Jeon et al. 2024, "Recursive Speculative Decoding" (recursive rejection sampling over a sampling without
  replacement): each test is one Leviathan / Chen speculative-sampling step of p_i against the x_i ~ q_i it really
  was drawn from, so its outcome follows p_i exactly, and a rejected x_i has p_{i+1}(x_i) = 0, so it may leave q.
- deterministic children (the drafter's top-k, or a dynamic tree's picks; greedy requests): q_i is one-hot at x_i,
  so x_i is accepted with probability p_i(x_i) and a rejection zeroes x_i in p. The outcome is then a sample of p
  that stops at the children holding it: the same law and acceptance as the `strict` walk. Deterministic children
  can gain nothing from q; sampled ones accept up to 1 - TV(p, q) at a node with one child, more with several.

When every child is rejected (or the node is a leaf) the bonus token is a sample of the node's last residual p_i.
On acceptance the walk moves to the child with that child's own p and q. Greedy rows pass p one-hot at the argmax:
the walk then accepts exactly the argmax's child and emits the argmax.

Randomness is an input (one U[0, 1) per node, one Exp(1) race per row for the bonus), so seeding stays the caller's.
The loops run over depth and sibling rank, never over requests or tokens; nothing here syncs with the host.
"""

from __future__ import annotations

import torch

from verispec.request import Request
from verispec.sample import logits as S
from verispec.sample.constraints import constrain_tokens
from verispec.sample.metadata import SpecDecodeMetadata, StepTokens, VerifyRule
from verispec.sample.tree import tree_accept
from verispec.sample.verify import categorical, draw_uniform

_TINY = torch.finfo(torch.float32).tiny


def tree_rejection_sample(
    # [B, 1 + N] node tokens (column 0: the root)
    tokens: torch.Tensor,
    # [B, 1 + N, V] the target's distribution at each node (greedy rows: one-hot at the argmax)
    target_probs: torch.Tensor,
    # [B, 1 + N, V] the drafter's distribution at each node, its children's law; None: every row deterministic
    draft_probs: torch.Tensor | None,
    # [B] bool: row b's children were sampled without replacement from draft_probs (else deterministic)
    sampled: torch.Tensor,
    # [B, 1 + N, R] each node's children in rank order (draw order when sampled), -1 padded
    children: torch.Tensor,
    max_depth: int,
    # [B, 1 + N] U[0, 1): the acceptance test of each node
    uniform: torch.Tensor,
    # [B] U[0, 1): the bonus token's inverse-CDF draw
    bonus_u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the deepest accepted node [B], the bonus token sampled after it [B])."""
    b, _, v = target_probs.shape
    dev = tokens.device
    rows = torch.arange(b, device=dev)
    r = children.shape[-1]
    # [B] the accepted node the walk stands on
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    # [B, V] p_i at cur (normalised), q_i at cur (unnormalised: rejected children zeroed)
    p = target_probs[:, 0].float()
    q = draft_probs[:, 0].float() if draft_probs is not None else None
    active = torch.ones(b, dtype=torch.bool, device=dev)
    for _ in range(max_depth):
        moved = torch.zeros(b, dtype=torch.bool, device=dev)
        for i in range(r):
            # [B]
            child = children[rows, cur, i]
            trying = active & ~moved & (child >= 0)
            c = child.clamp_min(0)
            # [B]
            x = tokens[rows, c]
            one_hot = torch.nn.functional.one_hot(x, v).to(p.dtype)
            px = p.gather(1, x[:, None]).squeeze(1)
            if q is None:
                det, qv = torch.ones_like(trying), one_hot
            else:
                mass = q.sum(-1, keepdim=True)
                # q exhausted (every token with mass drafted and rejected): the child is a function of the history
                det = ~sampled | (mass.squeeze(1) <= 0)
                qv = torch.where(det[:, None], one_hot, q / mass.clamp_min(_TINY))
            qx = qv.gather(1, x[:, None]).squeeze(1)
            # u < p(x) / q(x), without dividing by 0
            acc = trying & (uniform[rows, c] * qx < px)
            rej = trying & ~acc
            # [B, V] p_{i+1} = norm(max(0, p_i - q_i)); a float-level empty residual falls back to p_i without x
            res = (p - qv).clamp_min(0)
            total = res.sum(-1, keepdim=True)
            fallback = p * (1 - one_hot)
            res = torch.where(
                total > 0, res / total.clamp_min(_TINY), fallback / fallback.sum(-1, keepdim=True)
            )
            p = torch.where(rej[:, None], res, p)
            if q is not None:
                q = torch.where((rej & ~det)[:, None], q * (1 - one_hot), q)
            cur = torch.where(acc, c, cur)
            moved |= acc
        active &= moved
        # the accepted child's own distributions
        p = torch.where(moved[:, None], target_probs[rows, cur].float(), p)
        if q is not None:
            q = torch.where(moved[:, None], draft_probs[rows, cur].float(), q)
    bonus = categorical(p, bonus_u)
    return cur, bonus


def sample_children(
    # [B, V] the drafter's distribution at one node
    q: torch.Tensor,
    # number of children to draw
    k: int,
    # [B, V] Exp(1)
    noise: torch.Tensor,
) -> torch.Tensor:
    """[B, k] k tokens drawn without replacement from q, in draw order: the k largest q / Exp(1) (an exponential race
    run k times, i.e. Plackett-Luce / Gumbel-top-k). Tokens with q = 0 come last, only when q's support is used up."""
    return (q / noise.clamp_min(_TINY)).topk(k, dim=-1).indices


def verify_tree(
    reqs: list[Request],
    logits: torch.Tensor,
    spec: SpecDecodeMetadata,
    rule: VerifyRule,
    generator: torch.Generator | None,
) -> StepTokens:
    """A token tree per request, scored in one forward (logits [B * (1 + N), V], root first): walk it with the
    target's own pick at every node (tree_accept), or, under `probabilistic` with random requests, by recursive
    rejection sampling against the drafter's probabilities (tree_rejection_sample). Only position-independent
    processing applies (allowed ids, logit bias): the engine verifies the top-1 path as a chain where a request
    needs more."""
    tree = spec.tree
    b, n, v = len(reqs), tree.size + 1, logits.shape[-1]
    # [B][1 + N]
    nodes = [[r.last_token_id] + toks for r, toks in zip(reqs, spec.draft_token_ids)]
    if any(r.disallowed is not None or r.logit_bias_ids is not None for r in reqs):
        logits = logits.clone()
        constrain_tokens(logits.view(b, n, v), reqs, [[] for _ in reqs])
    params = [r.params for r in reqs]
    argmax = S.greedy(logits)
    dev = argmax.device
    tok = torch.tensor(nodes, device=dev)
    probs = greedy = None
    if not all(p.is_greedy for p in params):
        st = S.SamplingTensors.from_params(params, dev, v).repeat_interleave([n] * b)
        probs, greedy = S.logits_to_probs(logits, st), st.is_greedy
    if probs is not None and rule.method == "probabilistic":
        # greedy rows: one-hot at the argmax, their walk then follows the argmax
        target = torch.where(greedy[:, None], torch.nn.functional.one_hot(argmax, v).to(probs.dtype), probs)
        sampled = ~greedy.view(b, n)[:, 0]
        if spec.draft_probs is None:
            sampled = torch.zeros_like(sampled)
        gens = [r.generator for r in reqs]
        uniform = draw_uniform((b, n), gens, dev)
        bonus_u = S.draw_row_uniforms([1] * b, gens, dev, generator)
        children = tree.children().to(dev)
        args = (
            tok,
            target.view(b, n, v),
            spec.draft_probs,
            sampled,
            children,
            tree.max_depth,
            uniform,
            bonus_u,
        )
        deepest, bonus = tree_rejection_sample(*args)
        on_path = tree.ancestors.to(dev)[torch.arange(b, device=dev), deepest]
    else:
        depth = tree.depth.to(dev)
        # a node's pick reads the uniform of its position (depth), as plain decoding there would
        sample_u = None if probs is None else S.position_uniforms_of(reqs, depth).view(-1)
        # [B, 1 + N] the target's own pick at every node
        picks = S.greedy_or_sample(argmax, probs, sample_u, greedy).view(b, n)
        deepest, on_path = tree_accept(tok, picks, tree.parent.to(dev), tree.ancestors.to(dev), depth)
        bonus = picks.gather(1, deepest[:, None]).squeeze(1)
    # the step's host sync
    on_l, bonus_l = on_path.tolist(), bonus.tolist()
    emitted = [
        [t for t, on in zip(toks[1:], on[1:]) if on] + [x] for toks, on, x in zip(nodes, on_l, bonus_l)
    ]
    return StepTokens(emitted, [len(e) - 1 for e in emitted], None, n, on_l)
