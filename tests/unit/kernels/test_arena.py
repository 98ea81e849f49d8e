"""verispec/kernels/arena.py: a model's quantized weights moved into one huge-page buffer compute the same."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from verispec.kernels.arena import anonymous_buffer, move_weights_to_huge_pages
from verispec.kernels.qweight import kernels_available
from verispec.layers.linear import Dense

pytestmark = pytest.mark.skipif(not kernels_available(), reason="needs the native kernels")


@pytest.fixture
def layers() -> nn.Sequential:
    torch.manual_seed(0)
    out = nn.Sequential(Dense(64, 32), Dense(96, 48), Dense(64, 16))
    for m in out:
        nn.init.normal_(m.weight)
        assert m.quantize_q8()
    return out


def test_buffer_starts_on_a_huge_page_boundary():
    buf = anonymous_buffer(5000, huge_pages=True)
    assert buf.nbytes == 5000 and buf.ctypes.data % (2 << 20) == 0 and not buf.any()


def test_moved_weights_multiply_bitwise_the_same(layers):
    x = [torch.randn(5, m.in_features) for m in layers]
    before = [m(xi) for m, xi in zip(layers, x)]
    old = [m.qweight.blocks.ctypes.data for m in layers]
    moved = move_weights_to_huge_pages(layers)
    assert moved >= sum(m.qweight.nbytes for m in layers)
    addresses = [m.qweight.blocks.ctypes.data for m in layers]
    # one buffer, in module order, each weight on its own cache lines
    assert addresses != old and addresses == sorted(addresses)
    assert all(a % 64 == 0 for a in addresses) and addresses[-1] - addresses[0] < moved
    for m, xi, y in zip(layers, x, before):
        assert torch.equal(m(xi), y)


def test_switched_off_by_the_environment(layers, monkeypatch):
    monkeypatch.setenv("VERISPEC_HUGE_PAGES", "0")
    old = [m.qweight.blocks.ctypes.data for m in layers]
    assert move_weights_to_huge_pages(layers) == 0
    assert [m.qweight.blocks.ctypes.data for m in layers] == old
