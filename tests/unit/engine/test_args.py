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


NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


def test_per_request_spec_decode_metrics_takes_vllm_values():
    assert EngineArgs().per_request_spec_decode_metrics == "none"
    for level in ("none", "summary", "detailed"):
        assert EngineArgs(speculative_config=NGRAM, per_request_spec_decode_metrics=level)
    for bad in ("full", "", None, 1):
        with pytest.raises(
            ValueError, match=r"per_request_spec_decode_metrics=.*allowed: none, summary, detailed"
        ):
            EngineArgs(speculative_config=NGRAM, per_request_spec_decode_metrics=bad)


@pytest.mark.parametrize("level", ["summary", "detailed"])
def test_per_request_spec_decode_metrics_needs_a_speculative_config(level):
    """As vLLM: there is nothing to report without speculation."""
    with pytest.raises(ValueError, match=r"per_request_spec_decode_metrics=.* requires speculative decoding"):
        EngineArgs(per_request_spec_decode_metrics=level)
