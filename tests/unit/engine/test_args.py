"""EngineArgs: settings a user gives are checked where they are given, naming the setting."""

from __future__ import annotations

import pytest
import torch

from verispec.engine.args import EngineArgs


@pytest.mark.parametrize("threads", [0, -2, 1.5, True, "2"])
def test_threads_must_be_a_positive_integer(threads):
    with pytest.raises(ValueError, match=r"threads must be a positive integer"):
        EngineArgs(threads=threads)


def test_threads_set_the_process_thread_count(tiny_llama):
    from verispec import LLM

    before = torch.get_num_threads()
    try:
        LLM(tiny_llama, device="cpu", max_model_len=64, max_num_seqs=1, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
