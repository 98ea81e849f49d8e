"""The kernel library's load-time repacking (repack.c) writes exactly the bytes qweight.py's numpy code writes (the
path without a kernel library): GGUF Q4_K / Q6_K -> q4 / q6, q4 / q8 -> q4t / q8t, and dequantization."""

from __future__ import annotations

import numpy as np
import pytest

from tests.quant_blocks import make_weight
from verispec.kernels import qweight
from verispec.kernels.qweight import QuantWeight, kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no kernel library here")


@pytest.fixture
def numpy_only(monkeypatch):
    """Run qweight's numpy reference (as on a machine without the kernel library)."""

    def use():
        monkeypatch.setattr(qweight, "load_qgemm", lambda: None)

    return use


def _raw(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes, every float16 pattern included (subnormal, infinite and NaN scales)."""
    size = {"Q4_K": 144, "Q6_K": 210}[qtype]
    return np.random.default_rng(seed).integers(0, 256, size=(n, k // 256 * size), dtype=np.uint8)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("seed", [0, 1])
def test_gguf_repacking_matches_numpy(qtype, seed, numpy_only):
    raw = _raw(qtype, 48, 512, seed)
    fast = QuantWeight.from_gguf(raw, qtype, (48, 512))
    numpy_only()
    # NaN and infinite scales propagate alike
    with np.errstate(invalid="ignore"):
        ref = QuantWeight.from_gguf(raw, qtype, (48, 512))
    assert fast.fmt == ref.fmt
    assert np.array_equal(fast.blocks, ref.blocks)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0", "Q6_K"])
def test_tiling_and_dequantization_match_numpy(qtype, numpy_only):
    qw, values = make_weight(qtype, 32, 256, seed=3)
    tiled, w = qw.tiled(), qw.dequantize()
    numpy_only()
    assert np.array_equal(tiled.blocks, qw.tiled().blocks)
    assert np.array_equal(w.numpy(), qw.dequantize().numpy())
    assert np.array_equal(w.numpy(), values.numpy())
