"""Data parallelism with real replica processes: a replica that dies fails only its own requests, the others
finish with plain decoding's output and new requests go to the live replica; errors name the setting."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import REPEATED_SPAN_PROMPTS
from verispec import LLM, SamplingParams
from verispec.engine.args import EngineArgs
from verispec.engine.data_parallel import DataParallelEngine, ReplicaFailed

SAMPLING = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="data_parallel_size=2 needs two usable cores"
)


def test_a_dead_replica_fails_only_its_requests(tiny_llama):
    plain = LLM(tiny_llama, max_model_len=256)
    want = [o.outputs[0].token_ids for o in plain.generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)]
    engine = DataParallelEngine(EngineArgs(model=tiny_llama, max_model_len=256, data_parallel_size=2))
    try:
        # each replica on cores of its own (VERISPEC_CPU_BIND's default)
        a, b = (os.sched_getaffinity(r.proc.pid) for r in engine.replicas)
        assert a and b and not a & b
        for i, p in enumerate(REPEATED_SPAN_PROMPTS):
            engine.add_request(f"r{i}", None, p["prompt_token_ids"], SAMPLING)
        lost = engine.replicas[0]
        mine = set(lost.requests)
        assert 0 < len(mine) < len(REPEATED_SPAN_PROMPTS)
        lost.proc.kill()
        done, failed = {}, set()
        while engine.has_unfinished():
            try:
                outs = engine.step()
            except ReplicaFailed as e:
                failed |= set(e.request_ids)
                assert engine.running_request_ids() == e.request_ids
                continue
            done |= {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}
        assert failed == mine
        assert done == {f"r{i}": want[i] for i in range(len(want)) if f"r{i}" not in mine}
        # the survivor takes what comes next
        engine.add_request("again", None, REPEATED_SPAN_PROMPTS[0]["prompt_token_ids"], SAMPLING)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
        assert outs[0].outputs[0].token_ids == want[0]
        assert engine.stats().num_kv_slots == engine.info.num_kv_slots
    finally:
        engine.close()


def test_invalid_requests_are_refused_at_once_and_settings_are_checked(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=64, data_parallel_size=2)
    with pytest.raises(ValueError, match="longer than the maximum model length of 64"):
        llm.generate([{"prompt_token_ids": [5] * 80}], SAMPLING, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [10**6]}], SAMPLING, use_tqdm=False)
    assert llm.reset_prefix_cache()
    llm.shutdown()
    with pytest.raises(ValueError, match="data_parallel_size=64 x tensor_parallel_size=1 is more processes"):
        LLM(tiny_llama, data_parallel_size=64)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        LLM(tiny_llama, data_parallel_size=0)
    with pytest.raises(ValueError, match="no-such-model"):
        LLM("/no-such-model", data_parallel_size=2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' was requested but CUDA is not available"):
            LLM(tiny_llama, data_parallel_size=2, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replicas_on_the_gpu_decode_as_one_engine(tiny_llama):
    """Two replicas sharing GPU 0 (their KV budgets set), plain and with n-gram drafts: one CUDA engine's output."""
    kw = dict(max_model_len=256, device="cuda", dtype="bfloat16")
    one = LLM(tiny_llama, **kw)
    want = [o.outputs[0].token_ids for o in one.generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    for extra in ({}, {"speculative_config": spec}):
        llm = LLM(tiny_llama, data_parallel_size=2, kv_cache_memory_bytes=64 << 20, **kw, **extra)
        try:
            outs = llm.generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == want
        finally:
            llm.shutdown()
