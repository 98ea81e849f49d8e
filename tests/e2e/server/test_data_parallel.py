"""`verispec serve --data-parallel-size 2`: two replica processes behind one server; a conversation's next turn
is routed to the replica holding its history (its prefix cache hits), the counters are the replicas' sum, and
SIGTERM ends the replicas."""

from __future__ import annotations

import os

import psutil
import pytest

from tests.helpers import Server
from verispec import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="data_parallel_size=2 needs two usable cores"
)


def test_serve_with_two_replicas(tiny_llama, tmp_path):
    first = list(range(20, 60))
    plain = LLM(tiny_llama, max_model_len=256)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = plain.generate([{"prompt_token_ids": first}], sp, use_tqdm=False)[0].outputs[0]
    server = Server([tiny_llama, "-dp", "2", "--max-model-len", "256"], tmp_path / "serve.log").wait_ready()
    try:
        replicas = psutil.Process(server.proc.pid).children()
        assert len(replicas) == 2
        client = server.client()
        body = {"ignore_eos": True}
        out = client.completions.create(
            model=tiny_llama, prompt=first, max_tokens=8, temperature=0, extra_body=body
        )
        assert out.choices[0].text == want.text
        # an unrelated prompt (the other replica, by load), then the first conversation's next turn
        client.completions.create(
            model=tiny_llama, prompt=list(range(100, 140)), max_tokens=8, extra_body=body
        )
        hits = server.metric("vllm:prefix_cache_hits_total")
        turn2 = first + list(want.token_ids) + [5, 6, 7]
        client.completions.create(
            model=tiny_llama, prompt=turn2, max_tokens=8, temperature=0, extra_body=body
        )
        # its history's blocks were cached on the replica it went to (48 tokens: 3 blocks of 16)
        assert server.metric("vllm:prefix_cache_hits_total") - hits >= 32
        assert server.metric("vllm:request_success_total", finished_reason="length") == 3
        assert server.metric("vllm:generation_tokens_total") == 24
    finally:
        server.stop()
    psutil.wait_procs(replicas, timeout=30)
    assert not any(p.is_running() for p in replicas)
