"""A quantized embedding table stays in its blocks and each lookup dequantizes exactly the rows a float32 table
would hold."""

from __future__ import annotations

import pytest
import torch

from tests.quant_blocks import make_weight
from verispec.kernels.qweight import kernels_available
from verispec.layers import linear
from verispec.layers.embedding import Embedding


@pytest.mark.skipif(not kernels_available(), reason="no kernel library here")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q5_0", "Q8_0", "Q6_K"])
def test_quantized_lookup_equals_the_float_table(qtype):
    qw, values = make_weight(qtype, 40, 256, seed=5)
    emb = Embedding(40, qw.shape[1])
    emb.weight_loader(emb.weight, qw)
    assert emb.qweight is qw and emb.weight.numel() == 0
    ids = torch.tensor([[3, 0, 39], [7, 7, 12]])
    out = emb(ids)
    assert out.shape == (2, 3, qw.shape[1])
    assert torch.equal(out, values[ids])
    with pytest.raises(IndexError):
        emb(torch.tensor([40]))


def test_without_kernels_the_table_is_float(monkeypatch):
    qw, values = make_weight("Q8_0", 16, 64)
    monkeypatch.setattr(linear, "kernels_available", lambda: False)
    emb = Embedding(16, 64)
    emb.weight_loader(emb.weight, qw)
    assert emb.qweight is None
    assert torch.equal(emb(torch.tensor([2, 5])), values[[2, 5]])
