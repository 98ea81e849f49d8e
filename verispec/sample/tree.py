"""Token trees (`speculative_token_tree`), as pure structure and tensor functions.

A tree is vLLM's list of paths, breadth-first: node i + 1 is paths[i]; (r,) is the root's child of rank r (the
drafter's r-th most likely token), (r, s) that child's child of rank s, and so on. Node 0 is the root: the newest
committed token. The target scores the root and every node in one forward, each node attending to the prefix and to
its ancestors (`ancestor_mask`), at RoPE position start + depth.

Verification (`tree_accept`) walks down from the root: at each node it takes the target's own pick there (argmax for
greedy requests, a sample of the target's distribution for random ones: the `strict` rule), moves to the child holding
that token if there is one, and stops otherwise. Every emitted token is the target's pick at its position, so the
output follows the target exactly, whatever the tree held. Under `probabilistic`, static trees whose children were
sampled from the drafter are verified by recursive rejection sampling instead (sample/tree_verify.py).

A `DynamicTree` (`speculative_token_tree: "dynamic"`) is EAGLE-2's: each step the drafter grows the tree where its
own path confidence is highest and keeps the best nodes, so every request gets its own tree. A `TreeBatch` holds one
step's trees as tensors, one row per request; a static tree becomes one with `TokenTree.batch`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenTree:
    # node i + 1 = paths[i], breadth-first
    paths: tuple[tuple[int, ...], ...]

    @property
    # nodes, root excluded
    def size(self) -> int:
        return len(self.paths)

    @property
    # [1 + size]: parent node of each node (-1 for the root)
    def parent(self) -> list[int]:
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return [-1] + [index.get(p[:-1], 0) for p in self.paths]

    @property
    # [1 + size]
    def depth(self) -> list[int]:
        return [0] + [len(p) for p in self.paths]

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def children(self, node: int) -> list[tuple[int, int]]:
        """(rank, child node) of `node`'s children, by rank."""
        prefix = self.paths[node - 1] if node else ()
        return sorted((p[-1], i + 1) for i, p in enumerate(self.paths) if p[:-1] == prefix)

    @property
    def chain(self) -> list[int]:
        """The nodes of the all-top-1 path (0,), (0, 0), ...: what a chain drafter would have drafted."""
        return [i + 1 for i, p in enumerate(self.paths) if all(r == 0 for r in p)]

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """[1 + size, 1 + size] bool: m[i, j] = j is i or one of its ancestors."""
        parent, n = self.parent, self.size + 1
        m = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            m[i] |= m[parent[i]]
        return m.to(device)


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 dynamic trees: `depth` expansion steps; at each, the `topk` nodes of the newest level with the highest
    path confidence (product of draft probabilities from the root) get their `topk` most likely children; of every
    node drafted, the `num_nodes` most confident are verified (their ancestors are at least as confident, so they
    form a tree)."""

    topk: int
    # nodes verified per request, root excluded
    num_nodes: int
    depth: int

    @property
    def max_depth(self) -> int:
        return self.depth


@dataclass
class TreeBatch:
    """One step's token trees, one row per request, every tree with the same node count (node 0: the root)."""

    # [B, 1 + N] parent node (root: -1)
    parent: torch.Tensor
    # [B, 1 + N]
    depth: torch.Tensor
    # [B, 1 + N, 1 + N] bool ancestor-or-self
    ancestors: torch.Tensor
    # deepest node of any row (host int)
    max_depth: int
    # most children of any node (host int; None: read from parent, a host sync)
    width: int | None = None
    # host copies of parent and depth, [B][1 + N] each (dynamic trees carry them for the planner)
    host_parent: list[list[int]] | None = None
    host_depth: list[list[int]] | None = None

    @property
    def size(self) -> int:
        return self.parent.shape[1] - 1

    def children(self) -> torch.Tensor:
        """[B, 1 + N, R] the children of every node in breadth-first order (their rank order), -1 padded."""
        b, n = self.parent.shape
        # [B, 1 + N, 1 + N]: j < i and i, j siblings
        same = (self.parent[:, :, None] == self.parent[:, None, :]) & torch.ones(
            n, n, dtype=torch.bool, device=self.parent.device
        ).tril(-1)
        # [B, N] index of each node among its siblings
        rank = same.sum(-1)[:, 1:]
        r = self.width if self.width is not None else max(int(rank.max()) + 1 if n > 1 else 1, 1)
        out = torch.full((b, n * r), -1, dtype=torch.long, device=self.parent.device)
        nodes = torch.arange(1, n, device=self.parent.device).expand(b, -1)
        out.scatter_(1, self.parent[:, 1:] * r + rank, nodes)
        return out.view(b, n, r)

    def prefix(self, n: int) -> TreeBatch:
        """The trees' first n nodes (the root and nodes 1..n): a tree whenever every parent comes before its
        children, as in a dynamic tree's path-confidence order. Needs the host copies (max_depth without a sync)."""
        m = n + 1
        parents, depths = [p[:m] for p in self.host_parent], [d[:m] for d in self.host_depth]
        return TreeBatch(
            self.parent[:, :m],
            self.depth[:, :m],
            self.ancestors[:, :m, :m],
            max(max(d[1:], default=0) for d in depths),
            self.width,
            parents,
            depths,
        )

    def top_chains(self, token_ids: list[list[int]]) -> list[list[int]]:
        """Per request, the tokens along its first children from the root (the drafter's most likely path)."""
        out = []
        for par, toks in zip(self.parent.tolist(), token_ids):
            chain, node = [], 0
            # breadth-first: a node's first child is the first node naming it as parent
            for j in range(1, len(par)):
                if par[j] == node:
                    chain.append(toks[j - 1])
                    node = j
            out.append(chain)
        return out


def batch_of(tree: TokenTree, b: int, device=None) -> TreeBatch:
    """A static tree as a TreeBatch of b identical rows."""
    n = tree.size + 1
    return TreeBatch(
        torch.tensor(tree.parent, device=device).expand(b, n),
        torch.tensor(tree.depth, device=device).expand(b, n),
        tree.ancestor_mask(device).expand(b, n, n),
        tree.max_depth,
        max(Counter(tree.parent[1:]).values(), default=1),
    )


def ancestors_of(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parent [B, 1 + N] (root -1) -> [B, 1 + N, 1 + N] bool ancestor-or-self, by max_depth doublings of the
    parent's row (a loop over depth, not nodes)."""
    b, n = parent.shape
    eye = torch.eye(n, dtype=torch.bool, device=parent.device).expand(b, n, n)
    up = parent.clamp_min(0)[:, :, None].expand(b, n, n)
    anc = eye
    for _ in range(max_depth):
        # each node's row |= its parent's row (the root's own row stays itself)
        anc = eye | (torch.gather(anc, 1, up) & (parent >= 0)[:, :, None])
    return anc


def tree_accept(
    # [B, 1 + N] node tokens (column 0: the root, the newest committed token)
    tokens: torch.Tensor,
    # [B, 1 + N] the target's pick at each node (argmax or a sample of its distribution)
    picks: torch.Tensor,
    # [1 + N] or [B, 1 + N] parent node index (root: -1)
    parent: torch.Tensor,
    # [1 + N, 1 + N] or [B, 1 + N, 1 + N] bool ancestor-or-self mask
    ancestors: torch.Tensor,
    # [1 + N] or [B, 1 + N]
    depth: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the deepest accepted node [B], the nodes on its path [B, 1 + N] bool). A node is accepted when its token is
    its parent's pick and its parent is accepted; the accepted nodes form one path (siblings hold distinct tokens).
    The structure is one tree for every row, or one per row (dynamic trees)."""
    b, n = tokens.shape
    parent, depth = parent.expand(b, n), depth.expand(b, n)
    ancestors = ancestors.expand(b, n, n)
    # [B, N]
    match = tokens[:, 1:] == picks.gather(1, parent[:, 1:])
    # the root always stands
    match = torch.cat([torch.ones_like(match[:, :1]), match], dim=1)
    # [B, 1 + N]: every ancestor-or-self matched
    ok = ~((ancestors & ~match[:, None, :]).any(dim=-1))
    # unique: one accepted node per depth
    deepest = torch.where(ok, depth, -1).argmax(dim=1)
    # [B], [B, 1 + N]
    return deepest, ancestors[torch.arange(b, device=tokens.device), deepest]
