"""The CUDA path's Triton kernels compile for real GPUs, on a machine without one.

Triton's interpreter (test_cuda_ops.py) runs the kernels' arithmetic in numpy and never lowers them, so a kernel that
only a GPU compiler refuses (a type it cannot promote, a shape it cannot lay out) passes there. Here cuda_ops'
functions run as the decoder calls them with their launches recorded instead of run, and every recorded launch is
compiled ahead of time with Triton's own compiler and ptxas to machine code for Hopper (sm_90: H100, H200) and
Ampere (sm_80: A100). Without the interpreter: in a fresh interpreter, since the switch is read when Triton is
imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verispec.kernels import cuda_ops

ROOT = Path(__file__).resolve().parents[3]
TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}


class Recorder:
    """Stands for a Triton kernel: `kernel[grid](*args, **kw)` records the launch instead of running it."""

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((self.name, args, kw))


def record_launches() -> list[tuple[str, tuple, dict]]:
    """cuda_ops' Triton launches for the shapes and dtypes the CUDA decoder uses (CPU tensors: only dtypes and
    constants matter)."""
    launches: list = []
    fake = SimpleNamespace(rmsnorm=Recorder("rmsnorm", launches), attention=Recorder("attention", launches))
    real, cuda_ops._kernels = cuda_ops._kernels, fake
    try:
        for d in (576, 1536, 640):
            h = torch.zeros(3, d, dtype=torch.bfloat16)
            cuda_ops.add_rmsnorm(h, h, torch.zeros(d, dtype=torch.bfloat16), 1e-6)
            cuda_ops.add_rmsnorm(h, None, torch.zeros(d, dtype=torch.bfloat16), 1e-6)
        for hq, hkv, d, cap in ((9, 3, 64, None), (12, 2, 128, None), (4, 1, 256, 50.0)):
            for cache_dtype in (torch.bfloat16, torch.float16, torch.float32):
                q = torch.zeros(2, hq, 5, d, dtype=torch.bfloat16)
                cache = torch.zeros(10, 2 * hkv, 16, d, dtype=cache_dtype)
                blocks = torch.zeros(2, 4, dtype=torch.int64)
                mask = torch.ones(2, 1, 5, 60, dtype=torch.bool)
                visible = cuda_ops.visible_keys(mask, 60, q.device)
                cuda_ops.attention(q, cache[:, :hkv], cache[:, hkv:], 0.1, cap, visible, (blocks, 4))
    finally:
        cuda_ops._kernels = real
    return launches


def signature(args: tuple, kernel) -> dict:
    """A recorded launch's positional arguments -> their Triton types by the kernel's parameter names."""
    sig = {}
    for name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            sig[name] = "fp32"
    return sig


def compile_all(archs: tuple[int, ...]) -> int:
    """Compile every recorded launch for each architecture to a cubin (run without the interpreter)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from verispec.kernels import cuda_kernels

    done = 0
    for name, args, kw in record_launches():
        kernel = getattr(cuda_kernels, name)
        sig, consts = signature(args, kernel), {}
        options = {"num_warps": kw.pop("num_warps")}
        for key, value in kw.items():
            sig[key], consts[key] = "constexpr", value
        for arch in archs:
            compiled = triton.compile(
                ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32), options=options
            )
            assert compiled.asm["cubin"], (name, arch)
            done += 1
    return done


@pytest.mark.skipif(not cuda_ops.HAVE_TRITON, reason="needs Triton")
def test_every_launch_compiles_for_hopper_and_ampere(tmp_path):
    script = "from tests.unit.kernels.test_cuda_compile import compile_all; print(compile_all((90, 80)))"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # 6 norm launches and 9 attention launches, each for two architectures
    assert run.stdout.split()[-1] == "30"


def test_the_recorder_sees_what_the_decoder_launches():
    """The launches carry the dtypes they are given: a float16 cache under bfloat16 queries stays float16."""
    launches = record_launches()
    assert [n for n, _, _ in launches].count("attention") == 9
    kinds = {
        tuple(TYPES[a.dtype] for a in args if isinstance(a, torch.Tensor))
        for n, args, _ in launches
        if n == "attention"
    }
    assert ("bf16", "fp16", "fp16", "i64", "i32", "i32", "bf16") in kinds
