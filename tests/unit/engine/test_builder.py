"""build_engine's defaults and settings it refuses."""

from __future__ import annotations

import pytest
import torch

from verispec.engine.args import EngineArgs
from verispec.engine.builder import available_memory, start_tensor_parallel


def test_the_kv_budget_reads_available_not_free_memory():
    meminfo = "MemTotal:       24000000 kB\nMemFree:          100000 kB\nMemAvailable:   20000000 kB\n"
    assert available_memory(meminfo) == 20000000 << 10
    # no MemAvailable line (an old kernel): the free pages
    assert available_memory("MemTotal: 1 kB\n") > 0


def test_tensor_parallelism_on_a_gpu_is_refused_naming_the_device():
    """device='auto' on a GPU machine resolves to CUDA: the message says so and what to pass instead."""
    args = EngineArgs(model="unused", tensor_parallel_size=2)
    with pytest.raises(
        ValueError, match="tensor_parallel_size=2 runs on the CPU.*'auto' is cuda here: use device='cpu'"
    ):
        start_tensor_parallel(args, torch.device("cuda"))
