"""Dense (verispec/layers/linear.py): a fused layer's shards and the rows each one loads into."""

from __future__ import annotations

import pytest
import torch

from verispec.layers.linear import Dense


@pytest.fixture
def qkv() -> Dense:
    return Dense(8, 10, bias=True, shards={"q": 4, "k": 3, "v": 3})


def test_shard_rows_follow_the_declared_order(qkv):
    assert [qkv.shard_rows(s) for s in "qkv"] == [slice(0, 4), slice(4, 7), slice(7, 10)]
    assert qkv.shard_rows(None) == slice(0, 10)
    assert Dense(8, 6, shards={0: 2, 1: 4}).shard_rows(1) == slice(2, 6)
    with pytest.raises(KeyError, match=r"no shard 'x'; its shards: \['q', 'k', 'v'\]"):
        qkv.shard_rows("x")


def test_shards_must_cover_the_rows():
    with pytest.raises(ValueError, match="do not add up to out_features=10"):
        Dense(8, 10, shards={"q": 4, "k": 3, "v": 2})


def test_weight_loader_fills_only_its_shard(qkv):
    with torch.no_grad():
        qkv.weight.zero_()
    k = torch.randn(3, 8)
    qkv.weight_loader(qkv.weight, k, "k")
    qkv.weight_loader(qkv.bias, torch.ones(3), "v")
    assert torch.equal(qkv.weight[4:7], k) and not qkv.weight[:4].any() and not qkv.weight[7:].any()
    assert qkv.bias.tolist() == [0.0] * 7 + [1.0] * 3
    with pytest.raises(ValueError, match=r"^has shape \(4, 8\), expected \(3, 8\)$"):
        qkv.weight_loader(qkv.weight, torch.zeros(4, 8), "v")


def test_a_moved_layer_drops_its_packed_weight():
    """A layer packed for the CPU (MKL) and then cast or moved computes with the weight it now holds: a draft loaded
    on the CPU in float32 and moved to CUDA in bfloat16 used to call MKL with a bfloat16 weight."""
    layer = Dense(32, 16)
    torch.nn.init.normal_(layer.weight)
    layer.pack()
    x = torch.randn(3, 32)
    expected = x @ layer.weight.T
    layer.to(torch.bfloat16)
    assert layer._packed is None
    torch.testing.assert_close(layer.forward(x.bfloat16()), (x.bfloat16() @ layer.weight.T))
    layer.to(torch.float32)
    torch.testing.assert_close(layer.forward(x), expected, rtol=1e-2, atol=5e-2)


def test_file_layout_keeps_the_files_blocks():
    """A model about to take int8 activations keeps the file's q4 blocks (its int8 layouts are made from them), not
    the float32 kernels' layout (q4t tiles on the AMX build)."""
    from tests.quant_blocks import make_weight
    from verispec.kernels.qweight import kernels_available
    from verispec.layers.linear import keep_file_layouts

    if not kernels_available():
        pytest.skip("no kernel library here")
    qw, _ = make_weight("Q4_K", 32, 256)
    plain, kept = Dense(256, 32), Dense(256, 32)
    keep_file_layouts(kept)
    plain.load_quantized(qw)
    kept.load_quantized(qw)
    assert kept.qweight.fmt == "q4"
    assert plain.qweight.fmt == qw.for_kernels().fmt
    assert torch.equal(kept.qweight.dequantize(), plain.qweight.dequantize())
