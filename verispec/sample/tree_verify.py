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

from verispec.sample.verify import categorical

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
