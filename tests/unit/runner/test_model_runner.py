"""ModelRunner.build_context: the shortcut for chains that fill their slots agrees with the general padded path."""

from types import SimpleNamespace

import torch

from verispec.runner.model_runner import ModelRunner, RowInput


def runner() -> ModelRunner:
    model = SimpleNamespace(cfg=SimpleNamespace(sliding_window=None, layer_types=None))
    cache = SimpleNamespace(scratch=63, block_table=torch.zeros(4, 4, dtype=torch.long), block_shift=4)
    return ModelRunner(model, cache, torch.device("cpu"))


def test_dense_chain_matches_the_padded_path():
    """A 3-row chain alone (dense: no padding, no trees) and the same chain beside a 1-row sequence (padded): its
    positions, cache positions and mask rows are the same either way."""
    r = runner()
    chain = RowInput(0, 5, [7, 8, 9])
    _, pos_d, ctx_d, flat_d = r.build_context([chain])
    _, pos_p, ctx_p, _ = r.build_context([chain, RowInput(1, 2, [4])])
    assert ctx_d.qlen is None and ctx_d.pack is None
    assert ctx_p.qlen is not None
    assert torch.equal(pos_d[0], pos_p[0])
    assert torch.equal(ctx_d.cache_pos[0], ctx_p.cache_pos[0])
    assert torch.equal(ctx_d.cache_pos, torch.tensor([[5, 6, 7]]))
    # [1, 1, Q, T]: key t visible from query j iff t <= 5 + j
    assert ctx_d.mask.shape == (1, 1, 3, 8)
    assert torch.equal(ctx_d.mask[0, 0], ctx_p.mask[0, 0])
    assert torch.equal(ctx_d.mask[0, 0], torch.arange(8)[None] <= torch.tensor([5, 6, 7])[:, None])
    assert flat_d == [0, 1, 2]


def test_one_token_per_slot_and_a_lone_token():
    r = runner()
    _, pos, ctx, _ = r.build_context([RowInput(0, 4, [1]), RowInput(1, 2, [2])])
    assert torch.equal(pos, torch.tensor([[4], [2]]))
    assert torch.equal(ctx.mask[:, 0, 0], torch.arange(5)[None] <= torch.tensor([[4], [2]]))
    _, _, ctx, _ = r.build_context([RowInput(0, 4, [1])])
    assert ctx.mask is None and ctx.qlen is None


def test_tree_depths_are_not_a_chain():
    """A row with depths other than 0..q-1 (a token tree's) takes the general path: its RoPE positions are its
    depths."""
    r = runner()
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    _, pos, ctx, _ = r.build_context([RowInput(0, 5, [1, 2, 3], tree_mask=tree, depths=[0, 1, 1])])
    assert torch.equal(pos, torch.tensor([[5, 6, 6]]))
    assert torch.equal(ctx.cache_pos, torch.tensor([[5, 6, 7]]))
    # the third token sees the prefix, the root and itself, not its sibling
    assert ctx.mask[0, 0, 2].tolist() == [True] * 5 + [True, False, True]
