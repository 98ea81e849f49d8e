"""The quantized-weight kernels (verispec/kernels): exact dequantization, products, and bitwise batch invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tests.quant_blocks import TYPES, make_weight
from verispec.kernels import build
from verispec.kernels.qweight import QuantWeight

# every build this CPU can run: amx (4-bit weights on the tile unit, the rest as avx512), avx512, avx2
ISAS = [isa for isa in ("avx2", "avx512", "amx") if build.ISA_CPU_FLAGS[isa] <= build._cpu_flags()]


@pytest.fixture(params=ISAS)
def lib(request):
    if build.kernel_isa() is None or build.build_qgemm(request.param) is None:
        pytest.skip("no AVX2/FMA CPU or no C compiler here")
    return build.build_qgemm(request.param)


def product(qw: QuantWeight, x: torch.Tensor, lib) -> torch.Tensor:
    """x @ W^T with W in the layout `lib` runs (q4t on the amx build), as the model's layers do."""
    return qw.for_kernels(lib).matmul(x, lib)


@pytest.mark.parametrize("isa", ISAS)
def test_kernels_build_where_the_cpu_and_a_compiler_allow(isa):
    """A compile error must fail the suite, not turn every kernel test into a skip."""
    if build.kernel_isa() is None or build._compiler() is None:
        pytest.skip("no AVX2/FMA CPU or no C compiler here")
    lib = build.build_qgemm(isa)
    assert lib is not None, "the kernels did not compile: see the warning above"
    for name in build.ENTRY_POINTS:
        if isa == "amx" or name not in build.AMX_ONLY:
            assert hasattr(lib, name), name


def test_every_int8_weight_value_is_exact(lib):
    """All 256 int8 values (-128 too, which llama.cpp's Q8_0 never writes but a file may hold) in every position of
    a block and of a 16-column group: the kernel multiplies exactly the GGUF weights."""
    n, k = 32, 256
    # [N, K], each value in many places
    q = (np.arange(n * k).reshape(n, k) * 7 % 256 - 128).astype(np.int8)
    raw = np.zeros((n, k // 32, 34), np.uint8)
    raw[..., 0:2] = np.float16(0.5).reshape(1).view(np.uint8)
    raw[..., 2:] = q.reshape(n, k // 32, 32).view(np.uint8)
    raw = raw.reshape(n, -1)
    qw = QuantWeight.from_gguf(raw, "Q8_0", (n, k))
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0))
    assert torch.equal(ref, torch.from_numpy(q.astype(np.float32) * 0.5))
    assert torch.equal(qw.dequantize(), ref)
    assert torch.equal(product(qw, torch.eye(k), lib).T, ref)


@pytest.mark.parametrize("qtype", TYPES)
def test_repacked_blocks_dequantize_exactly(qtype):
    qw, ref = make_weight(qtype, 37, 96)
    assert torch.equal(qw.dequantize(), ref)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [21, 48])
def test_kernel_sees_exactly_the_gguf_weights(lib, qtype, n):
    qw, ref = make_weight(qtype, n, 64)
    # x = I picks out W^T column by column
    eye = torch.eye(qw.shape[1])
    assert torch.equal(product(qw, eye, lib).T, ref)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 1, 32), (1, 100, 576), (2, 17, 96), (3, 5, 64), (5, 33, 576), (13, 64, 1536), (37, 19, 128)]
    # N % 16 == 0: q4t
    + [(1, 48, 576), (4, 16, 32), (8, 96, 192), (10, 32, 64), (12, 48, 96), (45, 32, 64)],
)
def test_product_matches_float32(lib, qtype, m, n, k):
    qw, ref = make_weight(qtype, n, k, seed=m)
    x = torch.randn(m, qw.shape[1], generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(product(qw, x, lib), x @ ref.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_do_not_depend_on_the_batch_or_threads(lib, qtype):
    qw, _ = make_weight(qtype, 48, 192)
    qw = qw.for_kernels(lib)
    x = torch.randn(41, qw.shape[1], generator=torch.Generator().manual_seed(1))
    whole = qw.matmul(x, lib)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([qw.matmul(x[i : i + 1], lib) for i in range(41)])
    finally:
        torch.set_num_threads(threads)
    # bitwise: a row alone vs in every tile and 32-row sweep (41 rows: 32 + 9)
    assert torch.equal(whole, alone)
    for size in (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 17, 20, 21, 32, 33):
        parts = torch.cat([qw.matmul(x[i : i + size], lib) for i in range(0, 41, size)])
        assert torch.equal(whole, parts), size


def test_rows_and_fusion_keep_the_values():
    a, ra = make_weight("Q4_1", 8, 64, seed=1)
    b, rb = make_weight("Q4_1", 4, 64, seed=2)
    fused = QuantWeight.cat([a, b])
    assert fused.shape == (12, 64) and torch.equal(fused.dequantize(), torch.cat([ra, rb]))
    order = np.array([3, 1, 2, 0, 7, 5, 6, 4])
    assert torch.equal(a.take_rows(order).dequantize(), ra[order])
    c, _ = make_weight("Q8_0", 4, 64)
    # formats differ: the loader dequantizes instead
    assert QuantWeight.cat([a, c]) is None


def test_unsupported_shapes_stay_float32():
    assert QuantWeight.supported("Q4_1", (8, 64))
    assert QuantWeight.supported("Q4_K", (8, 256)) and not QuantWeight.supported("Q4_K", (8, 96))
    assert QuantWeight.supported("Q6_K", (8, 256)) and not QuantWeight.supported("Q6_K", (8, 96))
    # a type without a repacking (Q5_K) is dequantized to float32 by the loader
    assert not QuantWeight.supported("Q5_K", (8, 256))
    assert not QuantWeight.supported("Q8_0", (64,))
    with pytest.raises(ValueError, match="Q5_K"):
        QuantWeight.from_gguf(np.zeros((1, 176), np.uint8), "Q5_K", (1, 256))


def test_isa_override_and_switch(monkeypatch):
    monkeypatch.setenv("VERISPEC_KERNEL_ISA", "sse2")
    with pytest.raises(ValueError, match="VERISPEC_KERNEL_ISA.*allowed: avx2, avx512, amx"):
        build.kernel_isa()
    monkeypatch.setenv("VERISPEC_KERNEL_ISA", "avx2")
    assert build.kernel_isa() in (None, "avx2")
    monkeypatch.setenv("VERISPEC_KERNELS", "0")
    build.load_qgemm.cache_clear()
    try:
        assert build.load_qgemm() is None
    finally:
        build.load_qgemm.cache_clear()


@pytest.mark.parametrize(
    ("qtype", "fmt"), [("Q4_1", "q4t"), ("Q4_K", "q4t"), ("Q8_0", "q8t"), ("Q5_0", "q8t")]
)
def test_tiled_layout_keeps_the_weights(qtype, fmt):
    """q4 / q8 -> q4t / q8t (the AMX build's layouts) -> back is lossless; shapes that cannot be tiled stay."""
    qw, ref = make_weight(qtype, 48, 256)
    tiled = qw.tiled()
    assert tiled.fmt == fmt and tiled.nbytes == qw.nbytes
    assert torch.equal(tiled.dequantize(), ref)
    assert np.array_equal(tiled.untiled().blocks, qw.blocks)
    odd, _ = make_weight(qtype, 21, 256)
    # N not a multiple of 16
    assert odd.tiled() is odd


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", None])
def test_float_layout_follows_the_build(isa):
    """The float32 layout a test expects is asked of the kernels, never assumed: q4t / q8t only on the AMX build."""
    from types import SimpleNamespace

    from verispec.kernels.qweight import float_layout

    lib = SimpleNamespace(isa=isa)
    tiled = isa == "amx"
    assert float_layout("q4", lib) == ("q4t" if tiled else "q4")
    assert float_layout("q8", lib) == ("q8t" if tiled else "q8")
    assert float_layout("q6", lib) == "q6"
    qw, _ = make_weight("Q4_1", 16, 64)
    if build.kernel_isa() is not None:
        assert qw.for_kernels().fmt == float_layout("q4")


def test_tiled_weights_need_the_amx_build():
    qw, _ = make_weight("Q4_0", 16, 64)
    lib = build.build_qgemm("avx2") if build.kernel_isa() else None
    if lib is None:
        pytest.skip("no AVX2/FMA CPU or no C compiler here")
    assert qw.for_kernels(lib) is qw
    with pytest.raises(ValueError, match="amx"):
        qw.tiled().matmul(torch.zeros(1, 64), lib)


def test_isa_choice_follows_the_cpu_flags(monkeypatch):
    """amx where the CPU has AMX-BF16 + AVX512-BF16, else avx512, else avx2 (each with F16C: the float16 KV cache's
    conversions); asking for more than it has is an error."""
    base = {"avx2", "fma", "f16c"}
    avx512 = base | {"avx512f", "avx512dq"}
    amx = avx512 | {"avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"}
    monkeypatch.delenv("VERISPEC_KERNEL_ISA", raising=False)
    for flags, isa in [
        (set(), None),
        ({"avx2", "fma"}, None),
        (base, "avx2"),
        (avx512, "avx512"),
        (amx - {"amx_bf16"}, "avx512"),
        (amx, "amx"),
    ]:
        monkeypatch.setattr(build, "_cpu_flags", lambda flags=flags: flags)
        assert build.kernel_isa() == isa
    monkeypatch.setattr(build, "_cpu_flags", lambda: avx512)
    monkeypatch.setenv("VERISPEC_KERNEL_ISA", "amx")
    with pytest.raises(ValueError, match="VERISPEC_KERNEL_ISA=amx but this CPU lacks amx_bf16, amx_tile"):
        build.kernel_isa()


def test_long_prompts_keep_every_row(lib):
    """More rows than one pass of the AMX kernel (320): every row equals the row computed alone."""
    qw, ref = make_weight("Q4_1", 32, 64)
    qw = qw.for_kernels(lib)
    x = torch.randn(700, 64, generator=torch.Generator().manual_seed(3))
    whole = qw.matmul(x, lib)
    torch.testing.assert_close(whole, x @ ref.T, rtol=1e-5, atol=1e-4)
    for i in (0, 319, 320, 321, 699):
        assert torch.equal(whole[i : i + 1], qw.matmul(x[i : i + 1], lib))


def test_q8_quantizer_matches_ggufs():
    """QuantWeight.quantize_q8 (drafts following a quantized target) makes the blocks gguf's Q8_0 quantizer makes."""
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * torch.rand(48, 1) * 3
    # an all-zero block: d = 0
    w[3, :32] = 0
    raw = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    ref = QuantWeight.from_gguf(raw, "Q8_0", (48, 96)).dequantize()
    ours = QuantWeight.quantize_q8(w).dequantize()
    assert torch.equal(ours, ref)
    assert (ours - w).abs().max() <= w.abs().max() / 127
