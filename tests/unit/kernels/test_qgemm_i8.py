"""The int8-activation kernels (verispec/kernels/qgemm_i8.c): activation quantization, products against a float64
reference on the same int8 activations, and bitwise row independence, per weight type and per int8 variant."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tests.quant_blocks import TYPES, make_weight
from verispec.kernels import build, qweight
from verispec.kernels.qweight import QuantWeight

QK = 32
EPS32 = 2.0**-24


def _variant_or_skip(name: str) -> ctypes.CDLL:
    """This CPU's kernel library if it can run int8 variant `name`, else pytest.skip saying what is missing."""
    lib = build.load_qgemm()
    if lib is None:
        pytest.skip("no kernel library here (no AVX2/FMA CPU, no C compiler, or VERISPEC_KERNELS=0)")
    code, need = build.INT8_ISAS[name]
    missing = need - build._cpu_flags()
    if missing:
        pytest.skip(f"{name}: this CPU lacks {', '.join(sorted(missing))}")
    if not lib.qgemm_i8_isas() >> code & 1:
        pytest.skip(f"{name}: not in this build (the compiler is older than gcc 11)")
    if name == "amx-int8" and not lib.i8_amx_init():
        pytest.skip("amx-int8: the OS does not grant AMX tile state to this process")
    return lib


@pytest.fixture(params=list(build.INT8_ISAS))
def variant(request) -> tuple[ctypes.CDLL, str]:
    """(library, int8 variant name) for every variant this CPU runs; the others skip with the reason."""
    return _variant_or_skip(request.param), request.param


@pytest.fixture
def lib() -> ctypes.CDLL:
    lib = build.load_qgemm()
    if lib is None:
        pytest.skip("no kernel library here (no AVX2/FMA CPU, no C compiler, or VERISPEC_KERNELS=0)")
    return lib


def quantize_rows(lib, x: torch.Tensor) -> tuple[np.ndarray, ...]:
    """The library's activation quantization of x [M, K] -> q [M, K] int8, d [M, K/32] float32, d * sum(q)
    [M, K/32] float32, 128 * sum(q), 32 * sum(q of k 0-15) and 32 * sum(q of k 16-31), [M, K/32] int32 each
    (qgemm_i8.c's row layout, split)."""
    m, k = x.shape
    nb = k // QK
    x = x.contiguous()
    out = np.zeros((m, k + 20 * nb), np.uint8)
    lib.quantize_rows_i8(x.data_ptr(), m, k, out.ctypes.data, 1)
    tail = out[:, k:].copy()
    parts = [tail[:, 4 * nb * i : 4 * nb * (i + 1)] for i in range(5)]
    return (
        out[:, :k].view(np.int8),
        parts[0].view(np.float32),
        parts[1].view(np.float32),
        *(p.view(np.int32) for p in parts[2:]),
    )


def numpy_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_0 (its x86 SIMD path) with a float32 scale: per 32-block d = max|x| / 127,
    q = round-half-to-even(x * (127 / max|x|)) (q = 0 where max|x| = 0) -> q [M, K] int8, d [M, K/32] float32."""
    m, k = x.shape
    b = x.astype(np.float32).reshape(m, k // QK, QK)
    # [M, nb, 1]
    amax = np.abs(b).max(-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(b * inv).astype(np.int8)
    return q.reshape(m, k), d[..., 0]


def scale_sensitive_block() -> np.ndarray:
    """A 32-value block whose int8 values differ between the scale 127 / max|x| (llama.cpp's) and 1 / d: its max,
    then values just beside a rounding tie of one of the two scales."""
    for amax in (np.float32(1) + np.arange(1, 4000, dtype=np.float32) * np.float32(1e-3)).astype(np.float32):
        ours, other = np.float32(127) / amax, np.float32(1) / (amax / np.float32(127))
        if ours == other:
            continue
        for j in range(1, 127):
            v = np.float32((j + 0.5) / float(ours))
            for cand in (v, np.nextafter(v, np.float32(0)), np.nextafter(v, np.float32(200))):
                if np.rint(cand * ours) != np.rint(cand * other):
                    return np.array([amax, cand] + [0.0] * 30, np.float32)
    raise AssertionError("no block tells the two scales apart")


def reference(lib, x: torch.Tensor, w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """float64 x_int8 @ W^T on the library's int8 activations of x and W's float32 values -> (y [M, N], the sum of
    |terms| [M, N]: the scale of float32 rounding in the kernel's result)."""
    q, d, *_ = quantize_rows(lib, x)
    m, k = x.shape
    xq = (q.astype(np.float64).reshape(m, k // QK, QK) * d.astype(np.float64)[..., None]).reshape(m, k)
    w64 = w.double().numpy()
    return xq @ w64.T, np.abs(xq) @ np.abs(w64).T


def assert_matches_reference(y: torch.Tensor, ref: np.ndarray, scale: np.ndarray, k: int) -> None:
    """|y - ref| within float32 rounding: a few ulps per block's scale product, one rounding per block sum, and
    the float32 weight values (d * q + m rounded once) against their exact decomposition."""
    tol = (k // QK + 8) * EPS32 * scale + 1e-30
    err = np.abs(y.double().numpy() - ref)
    worst = float((err / tol).max())
    assert worst <= 1.0, f"error {worst:.2f}x the float32 bound"


def test_activation_quantization_matches_numpy(lib):
    """Blocks of 32, one float32 scale each, llama.cpp's rounding (half to even on x86); d * sum(q), 128 * sum(q) and
    32 * the sum of each 16-value half (q6v's correction) kept beside them. Bitwise, including an all-zero block, exact ties and a block whose largest value is negative."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 256, generator=g) * torch.logspace(-3, 2, 7).unsqueeze(1)
    x[1, 32:64] = 0
    # max |x| = 127: the scale is 1 and x * (127 / max) = x exactly, so these are exact ties
    x[2, :32] = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5] * 4)
    x[3, 64:96] = -torch.rand(32, generator=g) - 1.0
    x[4, 96:128] = torch.from_numpy(scale_sensitive_block())
    q, d, s, c, h0, h1 = quantize_rows(lib, x)
    ref_q, ref_d = numpy_quantize(x.numpy())
    assert np.array_equal(q, ref_q)
    assert np.array_equal(d, ref_d)
    # half to even, not half away from zero
    assert list(q[2, 1:8]) == [2, 4, -2, -4, 0, 0, 2]
    assert (q[1, 32:64] == 0).all() and d[1, 1] == 0
    assert q[3, 64:96].min() == -127
    amax, v = x[4, 96:98].numpy()
    assert q[4, 97] == np.rint(v * (np.float32(127) / amax)) != np.rint(v * (np.float32(1) / d[4, 3]))
    # [M, nb]
    total = q.astype(np.int64).reshape(7, -1, QK).sum(-1)
    assert np.array_equal(c, (128 * total).astype(np.int32))
    # [M, nb, 2]
    halves = q.astype(np.int64).reshape(7, -1, 2, 16).sum(-1)
    assert np.array_equal(h0, 32 * halves[..., 0]) and np.array_equal(h1, 32 * halves[..., 1])
    assert np.array_equal(s, d * total.astype(np.float32))
    # the quantization error is at most half a step per value (plus the rounding of the scale)
    d64 = d.astype(np.float64)[..., None]
    err = np.abs(q.reshape(7, -1, QK) * d64 - x.double().numpy().reshape(7, -1, QK))
    assert (err <= d64 * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_int8_layout_keeps_the_weights(qtype):
    """q4 / q8 / q6 -> q4v / q8v / q6v (the int8 kernels' layouts) -> back is lossless; N not a multiple of 16
    cannot."""
    qw, ref = make_weight(qtype, 48, 256)
    v = qw.for_int8(compact=False)
    assert v.fmt == {"q4": "q4v", "q8": "q8v", "q6": "q6v"}[qw.fmt]
    assert torch.equal(v.dequantize(), ref)
    # the C conversion (repack.c: int8_layout) is the numpy one, byte for byte
    assert np.array_equal(v.blocks, qw.for_int8(native=False).blocks)
    assert np.array_equal(v.untiled().blocks, qw.blocks)
    assert v.for_int8() is v
    if qw.tiled().fmt != qw.fmt:
        assert torch.equal(qw.tiled().for_int8().dequantize(), ref)
    odd, _ = make_weight(qtype, 21, 256)
    assert odd.for_int8() is None


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0"])
def test_compact_layouts_are_the_same_weights(variant, qtype):
    """Q4_K / Q6_K -> q4kv / q6kv (the scales factored back into float16 x integers), Q5_0 -> q5v (5-bit codes):
    the same weights in a quarter / a third / 40% fewer bytes, and bitwise q4v's / q6v's / q8v's products at every
    row count (AMX-INT8 from 33 rows: the tiles expanded from the compact blocks)."""
    lib, isa = variant
    qw, ref = make_weight(qtype, 48, 768)
    wide, compact = qw.for_int8(compact=False), qw.to_compact()
    assert compact.fmt == {"Q4_K": "q4kv", "Q6_K": "q6kv", "Q5_0": "q5v"}[qtype]
    assert compact.nbytes <= wide.nbytes * {"Q4_K": 0.78, "Q6_K": 0.67, "Q5_0": 0.62}[qtype]
    assert torch.equal(compact.dequantize(), ref)
    assert np.array_equal(compact.untiled().blocks, qw.blocks)
    assert compact.for_int8() is compact
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(3)) * 2
    x[0] = 0
    x[1, ::QK] = 1e4
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 17, 40):
        assert torch.equal(compact.matmul(x[:m], lib, isa), wide.matmul(x[:m], lib, isa)), f"{m} rows"


def test_compact_layouts_only_where_the_scales_factor(lib):
    """Q4_0 blocks (a float16 d per 32 weights) do not factor per super-block: q4v; Q8_0's q are not 5-bit: q8v;
    every int8 kernel reads the compact layouts (compact=False keeps the wide one)."""
    q40, _ = make_weight("Q4_0", 32, 512)
    assert q40.to_compact() is None
    assert q40.for_int8().fmt == "q4v"
    q80, _ = make_weight("Q8_0", 32, 512)
    assert q80.to_compact() is None
    assert q80.for_int8().fmt == "q8v"
    # K not a multiple of 64
    q50, _ = make_weight("Q5_0", 32, 96)
    assert q50.for_int8().fmt == "q8v"
    q4k, _ = make_weight("Q4_K", 32, 512)
    assert q4k.for_int8().fmt == "q4kv"
    assert q4k.for_int8(compact=False).fmt == "q4v"
    # from the AMX build's float32 tiles too
    assert q4k.tiled().fmt == "q4t" and q4k.tiled().for_int8().fmt == "q4kv"
    # rows not of whole super-blocks
    q6k, _ = make_weight("Q6_K", 32, 256)
    assert QuantWeight(q6k.fmt, q6k.blocks[:, : 4 * 40], (32, 128)).for_int8().fmt == "q6v"


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 16, 32),
        (1, 64, 576),
        (2, 32, 96),
        (5, 48, 576),
        (9, 32, 256),
        (16, 16, 32),
        (17, 64, 1536),
        (33, 48, 96),
        (40, 16, 64),
    ],
)
def test_product_matches_float64_on_the_int8_activations(variant, qtype, m, n, k):
    lib, isa = variant
    qw, w = make_weight(qtype, n, k, seed=m)
    k = qw.shape[1]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)) * 3
    y = qw.for_int8().matmul(x, lib, isa)
    ref, scale = reference(lib, x, w)
    assert_matches_reference(y, ref, scale, k)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
def test_extreme_activations(variant, qtype):
    """Rows with zero blocks, one huge value per block, int8 weights at -128 and Q6_K's full range (q -32..31,
    scales -128..127): still the reference."""
    lib, isa = variant
    n, k = 32, 256
    if qtype == "Q8_0":
        # every int8 value, -128 too (llama.cpp's quantizer never writes it; a file may hold it)
        qv = (np.arange(n * k).reshape(n, k) * 7 % 256 - 128).astype(np.int8)
        raw = np.zeros((n, k // QK, 34), np.uint8)
        raw[..., 0:2] = np.float16(0.25).reshape(1).view(np.uint8)
        raw[..., 2:] = qv.reshape(n, k // QK, QK).view(np.uint8)
        qw = QuantWeight.from_gguf(raw.reshape(n, -1), "Q8_0", (n, k))
        w = qw.dequantize()
    else:
        qw, w = make_weight(qtype, n, k)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(5))
    x[0] = 0
    x[1, 64:128] = 0
    x[2, ::QK] = 1e4
    x[3] = -1.0
    x[4] = torch.arange(k) % 3 - 1.0
    y = qw.for_int8().matmul(x, lib, isa)
    assert torch.equal(y[0], torch.zeros(n))
    ref, scale = reference(lib, x, w)
    assert_matches_reference(y, ref, scale, k)


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_do_not_depend_on_the_batch(variant, qtype):
    """Bitwise: a row alone equals the same row inside batches of every size 1..64 (AMX-INT8 takes over from 33
    rows, in 16-row tiles) and with one thread or two."""
    lib, isa = variant
    qw, _ = make_weight(qtype, 48, 256)
    qv = qw.for_int8()
    x = torch.randn(64, qv.shape[1], generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([qv.matmul(x[i : i + 1], lib, isa) for i in range(64)])
    finally:
        torch.set_num_threads(threads)
    for size in range(1, 65):
        parts = torch.cat([qv.matmul(x[i : i + size], lib, isa) for i in range(0, 64, size)])
        assert torch.equal(parts, alone), f"batches of {size} rows"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q6_K"])
def test_variants_agree_bitwise(qtype):
    """Every variant this CPU runs follows the same per-column float sequence: their results are bitwise equal,
    in every kernel build this CPU can run (avx2, avx512, amx), so a model gives the same tokens on each."""
    qw, _ = make_weight(qtype, 64, 512)
    qv = qw.for_int8()
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(4))
    results = {}
    for isa in ("avx2", "avx512", "amx"):
        if not build.ISA_CPU_FLAGS[isa] <= build._cpu_flags() or build._compiler() is None:
            continue
        lib = build.build_qgemm(isa)
        if lib is None:
            continue
        for name, (code, need) in build.INT8_ISAS.items():
            if need <= build._cpu_flags() and lib.qgemm_i8_isas() >> code & 1:
                if name == "amx-int8" and not lib.i8_amx_init():
                    continue
                results[f"{isa}/{name}"] = qv.matmul(x, lib, name)
    if not results:
        pytest.skip("no int8 variant on this CPU")
    first = next(iter(results.values()))
    for label, y in results.items():
        assert torch.equal(y, first), label


def test_long_prompts_keep_every_row(variant):
    """More rows than any tile or thread share: every row equals the row computed alone."""
    lib, isa = variant
    qw, w = make_weight("Q4_1", 32, 128)
    qv = qw.for_int8()
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(3))
    whole = qv.matmul(x, lib, isa)
    ref, scale = reference(lib, x, w)
    assert_matches_reference(whole, ref, scale, 128)
    for i in (0, 15, 16, 17, 255, 299):
        assert torch.equal(whole[i : i + 1], qv.matmul(x[i : i + 1], lib, isa))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_long_rows_in_chunks_keep_every_row(variant, qtype):
    """Rows long enough that AMX-INT8 runs the rows in chunks (each chunk's quantized rows kept in cache, the
    weights passed again per chunk): every row, in any chunk or the VNNI tail, equals the row computed alone."""
    lib, isa = variant
    qw, _ = make_weight(qtype, 32, 8192)
    qv = qw.for_int8()
    x = torch.randn(150, 8192, generator=torch.Generator().manual_seed(4))
    whole = qv.matmul(x, lib, isa)
    for i in (0, 47, 48, 63, 64, 95, 96, 143, 144, 149):
        assert torch.equal(whole[i : i + 1], qv.matmul(x[i : i + 1], lib, isa)), f"row {i}"


def test_no_int8_kernel_is_a_clear_error(monkeypatch):
    """Without an int8 kernel (no kernel library) the product refuses with a ValueError saying what it needs."""
    qw, _ = make_weight("Q8_0", 16, 64)
    qv = qw.for_int8()
    if build.load_qgemm() is None:
        pytest.skip("no kernel library here")
    monkeypatch.setattr(qweight, "int8_isa", lambda lib=None: None)
    with pytest.raises(ValueError, match="need the native kernels"):
        qv.matmul(torch.zeros(1, 64))


def test_int8_isa_choice_follows_the_cpu_flags(monkeypatch, lib):
    """amx-int8 > avx512vnni > avxvnni > avx2 by the CPU's flags (Zen 5: avx512vnni; Alder Lake: avxvnni; Zen 3:
    avx2); VERISPEC_INT8_ISA picks one, and asking for one the CPU lacks is an error naming it."""
    vnni512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    cases = [
        ({"avx2", "fma"}, "avx2"),
        ({"avx2", "fma", "avx_vnni"}, "avxvnni"),
        (vnni512, "avx512vnni"),
        (vnni512 | {"avx_vnni", "amx_tile", "amx_int8"}, "amx-int8"),
    ]
    monkeypatch.delenv("VERISPEC_INT8_ISA", raising=False)
    try:
        for flags, want in cases:
            monkeypatch.setattr(build, "_cpu_flags", lambda flags=flags: flags)
            build.int8_isa.cache_clear()
            got = build.int8_isa(lib)
            if want == "amx-int8" and not lib.i8_amx_init():
                want = "avx512vnni"
            assert got == want, flags
        monkeypatch.setattr(build, "_cpu_flags", lambda: vnni512)
        monkeypatch.setenv("VERISPEC_INT8_ISA", "avxvnni")
        build.int8_isa.cache_clear()
        with pytest.raises(ValueError, match="VERISPEC_INT8_ISA=avxvnni but this CPU"):
            build.int8_isa(lib)
        monkeypatch.setenv("VERISPEC_INT8_ISA", "sse4")
        build.int8_isa.cache_clear()
        with pytest.raises(ValueError, match="allowed: amx-int8, avx512vnni, avxvnni, avx2"):
            build.int8_isa(lib)
    finally:
        build.int8_isa.cache_clear()
