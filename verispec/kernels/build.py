"""Compile qgemm.c + ops.c + layers.c once per source version into a cache folder and load them with ctypes.

The kernel needs x86-64 with AVX2 + FMA and a C compiler (gcc or cc); it is built for the best the CPU has: 'amx'
(AVX-512 plus AMX-BF16 tiles for the quantized products, qgemm_amx.c), 'avx512' (16 lanes) or 'avx2' (8 lanes);
VERISPEC_KERNEL_ISA=avx2|avx512|amx overrides the choice. Without a
compiler or a suitable CPU, or with VERISPEC_KERNELS=0, `load_qgemm()` returns None and GGUF weights are
dequantized to float32 instead (same model, more bytes per token).
The OpenMP runtime the library links against resolves to the libgomp torch already loaded (same soname), so both
share one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

SOURCES = tuple(Path(__file__).with_name(n) for n in ("qgemm.c", "ops.c", "layers.c"))
AMX_SOURCE = Path(__file__).with_name(
    "qgemm_amx.c"
)  # the 'amx' build adds it: qgemm_q4t / q8t on the tile unit
CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_AVX512 = ("-mavx2", "-mfma", "-mavx512f", "-mavx512dq")
ISA_FLAGS = {
    "avx2": ("-mavx2", "-mfma"),
    "avx512": _AVX512,
    "amx": (*_AVX512, "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
}
ISA_CPU_FLAGS = {  # /proc/cpuinfo flags each build needs
    "avx2": {"avx2", "fma"},
    "avx512": {"avx2", "fma", "avx512f", "avx512dq"},
    "amx": {"avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"},
}
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_QGEMM = [_P, _I, _I, _P, _I, _P, _C]  # x, M, K, blocks, N, y, threads
# layers, n_layers, dims, h, S, Q, pack (or NULL), N, cos, ssin, slot_lo, cache_pos, kv_len, mask, ms, mq, scratch,
# threads
_DECODER_LAYERS = [_P, _I, _P, _P, _I, _I, _P, _I, _P, _P, _I, _P, _I, _P, _I, _I, _P, _C]
ENTRY_POINTS = {  # name -> (argtypes, restype); the C signatures are in qgemm.c / ops.c / layers.c
    "qgemm_q4": (_QGEMM, None),
    "qgemm_q8": (_QGEMM, None),
    "attention_f32": (
        [
            _P,
            _I,
            _I,
            _I,
            _I,
            _I,
            _I,
            _I,  # q, S, Hq, Q, D, q strides
            _P,
            _P,
            _I,
            _I,
            _I,
            _I,
            _I,  # k, v, Hkv, T, k/v strides
            _P,
            _I,
            _I,
            _F,
            _F,
            _P,
            _C,
        ],  # mask, mask strides, scale, softcap, out, threads
        None,
    ),  # fmt: skip
    "add_rmsnorm_f32": ([_P, _P, _P, _I, _I, _F, _P, _P], None),
    "silu_mul_f32": ([_P, _I, _I, _P, _C], None),
    "rope_f32": ([_P, _I, _I, _I, _I, _I, _I, _I, _P, _P], None),
    "write_kv_f32": ([_P, _I, _I, _I, _P, _I, _I, _I, _P, _I, _I, _I, _I], None),
    "argmax_rows_f32": ([_P, _I, _I, _I, _P, _C], None),
    "decoder_scratch_per_row": ([_P], _I),
    "decoder_layers_f32": (_DECODER_LAYERS, None),
}
AMX_ENTRY_POINTS = {"amx_init": ([], _C), "qgemm_q4t": (_QGEMM, None), "qgemm_q8t": (_QGEMM, None)}


def cache_dir() -> Path:
    root = os.environ.get("VERISPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "verispec"
    )
    return Path(root) / "kernels"


@functools.cache
def _cpu_flags() -> set[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        return set(
            Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split(":")[1].split()
        )
    except (OSError, IndexError):
        return set()


def kernel_isa() -> str | None:
    """'amx', 'avx512', 'avx2' or None (no usable vector unit): what load_qgemm builds for (the best this CPU has)."""
    flags = _cpu_flags()
    if not ISA_CPU_FLAGS["avx2"] <= flags:
        return None
    wanted = os.environ.get("VERISPEC_KERNEL_ISA", "").lower()
    if wanted not in ("", *ISA_FLAGS):
        raise ValueError(f"VERISPEC_KERNEL_ISA={wanted!r} is not supported; allowed: {', '.join(ISA_FLAGS)}")
    if wanted and not ISA_CPU_FLAGS[wanted] <= flags:
        missing = ", ".join(sorted(ISA_CPU_FLAGS[wanted] - flags))
        raise ValueError(f"VERISPEC_KERNEL_ISA={wanted} but this CPU lacks {missing}")
    if wanted:
        return wanted
    return next(isa for isa in ("amx", "avx512", "avx2") if ISA_CPU_FLAGS[isa] <= flags)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    return None


def _compile(compiler: str, flags: tuple[str, ...], target: Path, sources: tuple[Path, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, "-o", tmp, *map(str, sources)],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
        os.replace(tmp, target)  # atomic: concurrent processes never load a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_qgemm() -> ctypes.CDLL | None:
    """The kernel library for this CPU, or None (with one warning saying why) if it cannot be used here.

    Decided once per process (environment read at the first call)."""
    isa = kernel_isa()
    if os.environ.get("VERISPEC_KERNELS", "1") == "0" or isa is None:
        return None
    try:
        lib = build_qgemm(isa)
        # the OS refused the tile state, or the compiler has no AMX
        if lib is None and isa == "amx" and _compiler() and not os.environ.get("VERISPEC_KERNEL_ISA"):
            lib = build_qgemm("avx512")
    except Exception as exc:
        # e.g. an install without the C sources: the model still runs, on float32 weights
        warnings.warn(
            f"verispec: cannot build the kernels ({type(exc).__name__}: {str(exc)[:300]}); GGUF weights are "
            "dequantized to float32",
            stacklevel=2,
        )
        return None
    return lib


@functools.cache
def build_qgemm(isa: str, sources: tuple[Path, ...] = SOURCES) -> ctypes.CDLL | None:
    """Compile (once per source version, cached on disk) and load the library for `isa` ('avx2' | 'avx512' | 'amx').

    `sources`: qgemm.c, ops.c and layers.c (another version of them: benchmarks/kernel_sweep.py --baseline); the
    'amx' build adds qgemm_amx.c from the same folder. The library's `isa` attribute names its build."""
    compiler = _compiler()
    if compiler is None:
        warnings.warn("verispec: no C compiler found; GGUF weights are dequantized to float32", stacklevel=2)
        return None
    flags = (*CFLAGS, *ISA_FLAGS[isa])
    if isa == "amx":
        sources = (*sources, sources[0].with_name(AMX_SOURCE.name))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(flags).encode()).hexdigest()[
        :16
    ]
    target = cache_dir() / f"qgemm-{isa}-{digest}.so"
    try:
        if not target.exists():
            _compile(compiler, flags, target, sources)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        warnings.warn(f"verispec: kernel build failed ({detail.strip()[:300]}); using float32", stacklevel=2)
        return None
    entry_points = {**ENTRY_POINTS, **AMX_ENTRY_POINTS} if isa == "amx" else ENTRY_POINTS
    for name, (argtypes, restype) in entry_points.items():
        if sources[: len(SOURCES)] != SOURCES and not hasattr(lib, name):
            continue  # an older version of the sources (a benchmark's baseline) may lack newer entry points
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    if isa == "amx" and not lib.amx_init():
        warnings.warn("verispec: the OS does not grant AMX tile state to this process", stacklevel=2)
        return None
    lib.isa = isa
    return lib
