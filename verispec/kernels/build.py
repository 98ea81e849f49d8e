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
import re
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCES = tuple(
    Path(__file__).with_name(n) for n in ("qgemm.c", "ops.c", "layers.c", "qgemm_i8.c", "repack.c", "comm.c")
)
HEADER = Path(__file__).with_name("kernels.h")
# the 'amx' build adds it: qgemm_q4t / q8t on the tile unit
AMX_SOURCE = Path(__file__).with_name("qgemm_amx.c")
AMX_ONLY = ("amx_init", "qgemm_q4t", "qgemm_q8t")
CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_AVX512 = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512dq")
ISA_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": _AVX512,
    "amx": (*_AVX512, "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
}
# /proc/cpuinfo flags each build needs
ISA_CPU_FLAGS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512dq"},
    "amx": {"avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"},
}
# The int8-activation variants of qgemm_i8.c (compiled into every build), best first: name -> (code, CPU flags)
INT8_ISAS = {
    "amx-int8": (3, {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"}),
    "avx512vnni": (2, {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    "avxvnni": (1, {"avx2", "fma", "avx_vnni"}),
    "avx2": (4, {"avx2", "fma"}),
}
_C_TYPES = {
    "int64_t": ctypes.c_int64,
    "int32_t": ctypes.c_int32,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}


def _c_type(decl: str):
    """One C parameter or return type from kernels.h -> its ctypes type (None for void)."""
    decl = decl.replace("const", " ").strip()
    if "*" in decl:
        return ctypes.c_void_p
    base = decl.split()[0]
    if base == "void":
        return None
    if base not in _C_TYPES:
        raise ValueError(f"kernels.h: no ctypes mapping for C type {base!r}")
    return _C_TYPES[base]


def read_prototypes(header: Path = HEADER) -> dict[str, tuple[list, object]]:
    """kernels.h -> {function name: (ctypes argtypes, restype)} for every prototype it declares."""
    text = re.sub(r"//[^\n]*", "", header.read_text())
    entry_points = {}
    for ret, name, args in re.findall(r"^(\w+)\s+(\w+)\(([^;]*?)\);", text, flags=re.M | re.S):
        params = [a for a in args.split(",") if a.strip() and a.strip() != "void"]
        # each parameter is "type name": drop the name, keep the type (and its '*')
        entry_points[name] = (
            [_c_type(p.strip().rsplit(" ", 1)[0] + ("*" if "*" in p else "")) for p in params],
            _c_type(ret),
        )
    return entry_points


ENTRY_POINTS = read_prototypes()


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
    """Each source compiled on its own, in parallel (a first run waits for the slowest, not the sum), then linked."""
    target.parent.mkdir(parents=True, exist_ok=True)
    run = functools.partial(subprocess.run, check=True, capture_output=True, text=True, timeout=300)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{i}-{src.stem}.o") for i, src in enumerate(sources)]
        c_flags = [f for f in flags if f != "-shared"]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            jobs = [
                pool.submit(run, [compiler, *c_flags, "-c", "-o", o, str(src)])
                for o, src in zip(objects, sources)
            ]
            for job in jobs:
                job.result()
        lib = str(Path(tmp) / "lib.so")
        run([compiler, *flags, "-o", lib, *objects])
        # atomic: concurrent processes never load a half-written library
        os.replace(lib, target)


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


def _build_inputs(isa: str, sources: tuple[Path, ...]) -> tuple[tuple[Path, ...], tuple[str, ...]]:
    """The files and compiler flags of the `isa` build: the 'amx' one adds qgemm_amx.c from the sources' folder."""
    if isa == "amx":
        sources = (*sources, sources[0].with_name(AMX_SOURCE.name))
    return sources, (*CFLAGS, *ISA_FLAGS[isa])


def build_digest(isa: str, sources: tuple[Path, ...] = SOURCES) -> str:
    """What identifies the library build_qgemm compiles for `isa`: its sources, the headers beside them and the
    flags (the compiled library's name carries it; the step-cost profiles are cached per build with it)."""
    sources, flags = _build_inputs(isa, sources)
    # every header beside the sources (what they include) goes into the digest too
    extra = b"".join(h.read_bytes() for h in sorted(sources[0].parent.glob("*.h")))
    blob = b"".join(p.read_bytes() for p in sources) + extra + " ".join(flags).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@functools.cache
def build_qgemm(isa: str, sources: tuple[Path, ...] = SOURCES) -> ctypes.CDLL | None:
    """Compile (once per source version, cached on disk) and load the library for `isa` ('avx2' | 'avx512' | 'amx').

    `sources`: qgemm.c, ops.c and layers.c (another version of them: benchmarks/kernel_sweep.py --baseline); the
    'amx' build adds qgemm_amx.c from the same folder. The library's `isa` attribute names its build."""
    compiler = _compiler()
    if compiler is None:
        warnings.warn("verispec: no C compiler found; GGUF weights are dequantized to float32", stacklevel=2)
        return None
    target = cache_dir() / f"qgemm-{isa}-{build_digest(isa, sources)}.so"
    sources, flags = _build_inputs(isa, sources)
    try:
        if not target.exists():
            _compile(compiler, flags, target, sources)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        warnings.warn(f"verispec: kernel build failed ({detail.strip()[:300]}); using float32", stacklevel=2)
        return None
    # the prototypes of these sources (a baseline's own header, where it has one)
    header = sources[0].with_name(HEADER.name)
    entry_points = ENTRY_POINTS if header == HEADER or not header.exists() else read_prototypes(header)
    for name, (argtypes, restype) in entry_points.items():
        if isa != "amx" and name in AMX_ONLY:
            continue
        if sources[: len(SOURCES)] != SOURCES and not hasattr(lib, name):
            # an older version of the sources (a benchmark's baseline) may lack newer entry points
            continue
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    if isa == "amx" and not lib.amx_init():
        warnings.warn("verispec: the OS does not grant AMX tile state to this process", stacklevel=2)
        return None
    lib.isa = isa
    return lib


@functools.cache
def int8_isa(lib: ctypes.CDLL | None = None) -> str | None:
    """The int8-activation kernel this CPU runs best ('amx-int8' > 'avx512vnni' > 'avxvnni' > 'avx2'), or None if
    there is no kernel library. VERISPEC_INT8_ISA=amx-int8|avx512vnni|avxvnni|avx2 overrides the choice
    (ValueError if this CPU lacks it). AMX-INT8 needs the OS to grant the tile state; without it, AVX512-VNNI."""
    lib = lib or load_qgemm()
    if lib is None or not hasattr(lib, "qgemm_i8"):
        return None
    flags, built = _cpu_flags(), lib.qgemm_i8_isas()
    usable = [name for name, (code, need) in INT8_ISAS.items() if need <= flags and built >> code & 1]
    wanted = os.environ.get("VERISPEC_INT8_ISA", "").lower()
    if wanted and wanted not in INT8_ISAS:
        raise ValueError(f"VERISPEC_INT8_ISA={wanted!r} is not supported; allowed: {', '.join(INT8_ISAS)}")
    if wanted and wanted not in usable:
        raise ValueError(f"VERISPEC_INT8_ISA={wanted} but this CPU (or this build) lacks it")
    if wanted:
        usable = [wanted]
    if usable and usable[0] == "amx-int8" and not lib.i8_amx_init():
        if wanted:
            raise ValueError(
                "VERISPEC_INT8_ISA=amx-int8 but the OS does not grant AMX tile state to this process"
            )
        usable = usable[1:]
    return usable[0] if usable else None
