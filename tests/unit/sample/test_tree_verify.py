"""Recursive rejection sampling over a token tree: hand-checked cases, and the law of the emitted tokens."""

import pytest
import torch

from verispec.audit import chi2_pvalue
from verispec.sample.tree import TokenTree, batch_of
from verispec.sample.tree_verify import sample_children, tree_rejection_sample

# root -> 3 children (ranks 0, 1, 2); the first two have 2 children each
TREE = TokenTree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1)))
V = 6


def _run(tokens, p, q, sampled, uniform, bonus_u, tree=TREE):
    tb = batch_of(tree, tokens.shape[0])
    return tree_rejection_sample(tokens, p, q, sampled, tb.children(), tree.max_depth, uniform, bonus_u)


def test_greedy_rows_accept_exactly_the_argmax_path():
    # root argmax 2 -> node 2 (rank 1); its argmax 5 -> node 7 (rank (1, 1)); its argmax 1: the bonus
    tokens = torch.tensor([[0, 3, 2, 4, 0, 1, 3, 5]])
    p = torch.zeros(1, 8, V)
    p[0, 0, 2] = p[0, 2, 5] = p[0, 7, 1] = 1
    p[0, [1, 3, 4, 5, 6], 0] = 1
    deepest, bonus = _run(tokens, p, None, torch.tensor([False]), torch.full((1, 8), 0.999), torch.zeros(1))
    assert deepest.tolist() == [7] and bonus.tolist() == [1]


def test_sampled_child_rejected_then_residual():
    """One sampled child, p = (.5, .5), q = (.9, .1), child = token 0: accepted iff u < 5/9; after a rejection the
    residual is (0, 1): the bonus must be token 1 whatever its uniform."""
    tree = TokenTree(((0,),))
    tokens = torch.tensor([[0, 0], [0, 0]])
    p = torch.tensor([0.5, 0.5] + [0.0] * (V - 2)).expand(2, 2, V).clone()
    q = torch.tensor([0.9, 0.1] + [0.0] * (V - 2)).expand(2, 2, V).clone()
    uniform = torch.tensor([[0.0, 0.5], [0.0, 0.6]])
    deepest, bonus = _run(tokens, p, q, torch.tensor([True, True]), uniform, torch.zeros(2), tree)
    # row 0: 0.5 * 0.9 < 0.5 accepted (bonus from the child's p: u = 0 draws token 0)
    assert deepest.tolist() == [1, 0] and bonus.tolist() == [0, 1]


def _laws(seed: int):
    g = torch.Generator().manual_seed(seed)
    # peaked, unlike each other: rejections, residuals and second siblings all matter
    p1 = torch.softmax(2 * torch.randn(V, generator=g), 0)
    p2 = torch.softmax(2 * torch.randn(V, V, generator=g), 1)
    q1 = torch.softmax(2 * torch.randn(V, generator=g), 0)
    q2 = torch.softmax(2 * torch.randn(V, V, generator=g), 1)
    return p1, p2, q1, q2


def _draw_pairs(n: int, seed: int, q_verify_scale: float = 1.0) -> torch.Tensor:
    """n rows of one tree: children drawn without replacement from q, verified; -> [n] flat index t1 * V + t2 of
    the two first emitted tokens. q_verify_scale != 1: the verifier is told a wrong q (the test's power)."""
    p1, p2, q1, q2 = _laws(seed)
    g = torch.Generator().manual_seed(seed + 1)
    tb = batch_of(TREE, n)
    kids = tb.children()

    def exp() -> torch.Tensor:
        return torch.empty(n, V).exponential_(generator=g)

    tokens = torch.zeros(n, 8, dtype=torch.long)
    # root's 3 children, then each of nodes 1, 2's two children
    tokens[:, 1:4] = sample_children(q1.expand(n, V), 3, exp())
    for node in (1, 2):
        qn = q2[tokens[:, node]]
        tokens[:, kids[0, node, :2]] = sample_children(qn, 2, exp())
    # target / draft law at each node: p1 at the root, p2(. | own token) below
    target = p2[tokens]
    target[:, 0] = p1
    draft = q2[tokens]
    draft[:, 0] = q1
    if q_verify_scale != 1.0:
        draft = draft**q_verify_scale
    sampled = torch.ones(n, dtype=torch.bool)
    uniform = torch.rand(n, 8, generator=g)
    deepest, bonus = tree_rejection_sample(
        tokens, target, draft, sampled, kids, 2, uniform, torch.rand(n, generator=g)
    )
    depth = tb.depth[0]
    anc = tb.ancestors[0]
    # emitted: the accepted path's tokens, then the bonus
    on = anc[deepest][:, 1:]
    d = depth[deepest]
    first = torch.where(d >= 1, torch.where(on & (depth[1:] == 1), tokens[:, 1:], 0).sum(1), bonus)
    second = torch.where(d >= 2, torch.where(on & (depth[1:] == 2), tokens[:, 1:], 0).sum(1), bonus)
    # a depth-0 stop emits one token only: draw its successor from the target as plain decoding would
    second = torch.where(d == 0, (p2[first] / torch.empty(n, V).exponential_(generator=g)).argmax(1), second)
    return first * V + second


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_emitted_tokens_follow_the_target_law(seed):
    """The first two emitted tokens' joint law is p1(t1) p2(t2 | t1) exactly (chi-square, 36 cells, 100k rows);
    a verifier told a wrong q fails the same test."""
    p1, p2, _, _ = _laws(seed)
    joint = (p1[:, None] * p2).reshape(-1).double()
    counts = torch.bincount(_draw_pairs(100_000, seed), minlength=V * V).double()
    assert chi2_pvalue(counts, joint) > 1e-4
    wrong = torch.bincount(_draw_pairs(100_000, seed, q_verify_scale=0.5), minlength=V * V).double()
    assert chi2_pvalue(wrong, joint) < 1e-4
