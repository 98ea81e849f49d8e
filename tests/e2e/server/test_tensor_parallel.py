"""`verispec serve --tensor-parallel-size 2`: the OpenAI client gets plain decoding's tokens under the same layout,
and SIGTERM ends the other rank's process too."""

from __future__ import annotations

import os

import psutil
import pytest

from tests.helpers import Server
from verispec import LLM, SamplingParams


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor_parallel_size=2 needs two usable cores")
def test_serve_with_two_ranks(tiny_llama, tmp_path):
    prompt = [7, 40, 41, 42, 40, 41, 42, 40, 41, 42, 9]
    plain = LLM(tiny_llama, max_model_len=256, tensor_parallel_size=2)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = plain.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].text
    plain.shutdown()
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    args = [tiny_llama, "-tp", "2", "--max-model-len", "256", "--speculative-config", spec]
    server = Server(args, tmp_path / "serve.log").wait_ready()
    try:
        ranks = psutil.Process(server.proc.pid).children()
        assert len(ranks) == 1
        out = server.client().completions.create(
            model=tiny_llama, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == want
    finally:
        server.stop()
    # the server re-raises SIGTERM once drained (uvicorn's way); its rank is told to stop before that
    assert "shutting down" in (tmp_path / "serve.log").read_text()
    psutil.wait_procs(ranks, timeout=10)
    assert not any(p.is_running() for p in ranks)
