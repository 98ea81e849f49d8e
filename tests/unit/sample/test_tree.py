"""Token trees: structure from vLLM's path lists, and the walk that accepts the target's own picks."""

import torch

from verispec.sample.tree import TokenTree, ancestors_of, batch_of, tree_accept

# root -> (0,) a, (1,) b;  a -> (0, 0) c, (0, 1) d;  c -> (0, 0, 0) e
TREE = TokenTree(((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))


def test_structure():
    assert TREE.parent == [-1, 0, 0, 1, 1, 3]
    assert TREE.depth == [0, 1, 1, 2, 2, 3] and TREE.max_depth == 3
    assert (
        TREE.children(0) == [(0, 1), (1, 2)]
        and TREE.children(1) == [(0, 3), (1, 4)]
        and TREE.children(2) == []
    )
    assert TREE.chain == [1, 3, 5]
    m = TREE.ancestor_mask()
    assert m[5].nonzero().flatten().tolist() == [0, 1, 3, 5] and m[2].nonzero().flatten().tolist() == [0, 2]


def _accept(tokens, picks):
    t = TREE
    deepest, on_path = tree_accept(
        torch.tensor(tokens),
        torch.tensor(picks),
        torch.tensor(t.parent),
        t.ancestor_mask(),
        torch.tensor(t.depth),
    )
    return deepest.tolist(), on_path.tolist()


def test_walk_follows_the_target_picks():
    #        node:   0   a   b   c   d   e
    tokens = [[50, 11, 12, 13, 14, 15]] * 4
    picks = [
        # root picks a, a picks c, c picks e: all three accepted, bonus from e
        [11, 13, 0, 15, 0, 99],
        # root picks b (the second branch): one accepted
        [12, 0, 0, 0, 0, 0],
        # a then d (a's second child)
        [11, 14, 0, 0, 0, 0],
        # the root's pick is in no child: nothing accepted (deeper matches don't count)
        [
            77,
            13,
            0,
            15,
            0,
            0,
        ],
    ]
    deepest, paths = _accept(tokens, picks)
    assert deepest == [5, 2, 4, 0]
    assert [[i for i, on in enumerate(p) if on] for p in paths] == [[0, 1, 3, 5], [0, 2], [0, 1, 4], [0]]


def test_batch_structure_matches_the_static_tree():
    tb = batch_of(TREE, 2)
    assert tb.size == 5 and tb.max_depth == 3
    assert torch.equal(ancestors_of(tb.parent, 3), tb.ancestors)
    # children by rank, -1 padded: root -> a, b; a -> c, d; c -> e
    assert tb.children()[0].tolist() == [[1, 2], [3, 4], [-1, -1], [5, -1], [-1, -1], [-1, -1]]
    assert tb.top_chains([[11, 12, 13, 14, 15]]) == [[11, 13, 15]]


def test_walk_with_one_tree_per_row():
    """Dynamic trees: row 0 is TREE, row 1 a chain of 5; each row walks its own structure."""
    chain = TokenTree(((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)))
    rows = [batch_of(TREE, 1), batch_of(chain, 1)]
    parent = torch.cat([r.parent for r in rows])
    anc = torch.cat([r.ancestors for r in rows])
    depth = torch.cat([r.depth for r in rows])
    tokens = torch.tensor([[50, 11, 12, 13, 14, 15], [50, 11, 12, 13, 14, 15]])
    # row 0: root picks b (node 2); row 1: 11, 12, 13 match, then 99
    picks = torch.tensor([[12, 0, 0, 0, 0, 0], [11, 12, 13, 99, 0, 0]])
    deepest, on_path = tree_accept(tokens, picks, parent, anc, depth)
    assert deepest.tolist() == [2, 3]
    assert [[i for i, on in enumerate(p) if on] for p in on_path.tolist()] == [[0, 2], [0, 1, 2, 3]]
    assert batch_of(chain, 1).top_chains([[11, 12, 13, 14, 15]]) == [[11, 12, 13, 14, 15]]
