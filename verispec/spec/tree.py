"""Token trees (`speculative_token_tree`), as pure structure and tensor functions.

A tree is vLLM's list of paths, breadth-first: node i + 1 is paths[i]; (r,) is the root's child of rank r (the
drafter's r-th most likely token), (r, s) that child's child of rank s, and so on. Node 0 is the root: the newest
committed token. The target scores the root and every node in one forward, each node attending to the prefix and to
its ancestors (`ancestor_mask`), at RoPE position start + depth.

Verification (`tree_accept`) walks down from the root: at each node it takes the target's own pick there (argmax for
greedy requests, a sample of the target's distribution for random ones: the `strict` rule), moves to the child holding
that token if there is one, and stops otherwise. Every emitted token is the target's pick at its position, so the
output follows the target exactly, whatever the tree held.
"""

from __future__ import annotations

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


def tree_accept(
    # [B, 1 + N] node tokens (column 0: the root, the newest committed token)
    tokens: torch.Tensor,
    # [B, 1 + N] the target's pick at each node (argmax or a sample of its distribution)
    picks: torch.Tensor,
    # [1 + N] parent node index (root: -1)
    parent: torch.Tensor,
    # [1 + N, 1 + N] bool ancestor-or-self mask
    ancestors: torch.Tensor,
    # [1 + N]
    depth: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the deepest accepted node [B], the nodes on its path [B, 1 + N] bool). A node is accepted when its token is
    its parent's pick and its parent is accepted; the accepted nodes form one path (siblings hold distinct tokens)."""
    # [B, N]
    match = tokens[:, 1:] == picks.gather(1, parent[1:].expand(tokens.shape[0], -1))
    # the root always stands
    match = torch.cat([torch.ones_like(match[:, :1]), match], dim=1)
    # [B, 1 + N]: every ancestor-or-self matched
    ok = ~((ancestors[None] & ~match[:, None, :]).any(dim=-1))
    # unique: one accepted node per depth
    deepest = torch.where(ok, depth[None], -1).argmax(dim=1)
    # [B], [B, 1 + N]
    return deepest, ancestors[deepest]
