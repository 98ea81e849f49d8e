"""TrimmedHead (verispec/layers/trimmed_head.py): the kept rows' logits exactly the full head's, -inf elsewhere."""

from __future__ import annotations

import pytest
import torch

from verispec.kernels.qweight import kernels_available
from verispec.layers.linear import Dense
from verispec.layers.trimmed_head import trim_head

V, H = 96, 64


def _head(seed: int = 0) -> Dense:
    head = Dense(H, V)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=torch.Generator().manual_seed(seed)))
    head.pack()
    return head


def _check(head: Dense, keep: torch.Tensor) -> None:
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    full = head.forward(x)
    trimmed = trim_head(head, keep)
    assert trimmed.out_features == V
    out = trimmed.forward(x)
    assert out.shape == (5, V)
    assert torch.equal(out[:, keep], full[:, keep])
    others = torch.ones(V, dtype=torch.bool)
    others[keep] = False
    assert torch.isneginf(out[:, others]).all()
    # argmax never leaves the kept ids
    assert set(out.argmax(-1).tolist()) <= set(keep.tolist())


KEEP = torch.tensor([*range(10), 17, 40, 41, 63, 80, 95])


def test_float_rows():
    _check(_head(), KEEP)


@pytest.mark.skipif(not kernels_available(), reason="quantized heads need the native kernels")
@pytest.mark.parametrize("int8", [False, True], ids=["float32 activations", "int8 activations"])
def test_quantized_rows_keep_their_blocks(int8):
    head = _head()
    assert head.quantize_q8()
    if int8:
        assert head.use_int8_activations()
    _check(head, KEEP)
    assert trim_head(head, KEEP).dense.qweight.fmt == head.qweight.fmt


def test_a_trimmed_head_takes_int8_activations_like_the_full_one():
    if not kernels_available():
        pytest.skip("int8 activations need the native kernels")
    head = _head()
    assert head.quantize_q8()
    trimmed = trim_head(head, KEEP)
    assert trimmed.dense.use_int8_activations() and head.use_int8_activations()
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    assert torch.equal(trimmed.forward(x)[:, KEEP], head.forward(x)[:, KEEP])
