"""Tensor parallelism with real rank processes: the fused C layers (GGUF, float32 and int8) and the gloo transport
lossless against plain decoding under the same layout, errors that name the setting, shutdown and a dead rank."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPEATED_SPAN_PROMPTS, free_port
from tests.tiny_models import write_tiny_checkpoint
from verispec import LLM, SamplingParams
from verispec.distributed.cpus import cpulist
from verispec.kernels.build import load_qgemm

SAMPLING = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="tensor_parallel_size=2 needs two usable cores"
)


def _tokens(llm: LLM, sampling: SamplingParams = SAMPLING) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(REPEATED_SPAN_PROMPTS, sampling, use_tqdm=False)]


@needs_two_cores
@pytest.mark.skipif(load_qgemm() is None, reason="the fused layers need the native kernels")
@pytest.mark.parametrize("activation_dtype", ["float32", "int8"])
def test_fused_layers_speculation_equals_plain_under_tp2(tiny_gguf, activation_dtype):
    args = dict(max_model_len=256, tensor_parallel_size=2, activation_dtype=activation_dtype)
    plain = LLM(tiny_gguf, **args)
    assert plain.engine.runner.model.fused is not None
    # kv_cache_dtype "auto": float16 under int8 activations, on every rank (the plan carries it)
    kv = {t.dtype for t in plain.engine.runner.cache.kv}
    assert kv == {torch.float16 if activation_dtype == "int8" else torch.float32}
    want = _tokens(plain)
    plain.shutdown()
    spec = LLM(tiny_gguf, speculative_config=NGRAM, **args)
    assert _tokens(spec) == want
    assert spec.engine.counters.spec.num_draft_tokens > 0
    spec.shutdown()


@needs_two_cores
@pytest.mark.skipif(load_qgemm() is None, reason="the fused layers need the native kernels")
def test_eagle_on_a_gguf_target_drafts_with_rank_0s_whole_head(tiny_gguf, tiny_eagle):
    """EAGLE uses the target's LM head, which the ranks hold in shards: rank 0 reads the whole (quantized) head
    again from the GGUF for it; the output is TP=2 plain decoding's."""
    plain = LLM(tiny_gguf, max_model_len=256, tensor_parallel_size=2)
    want = _tokens(plain)
    plain.shutdown()
    spec = {"method": "eagle", "model": tiny_eagle, "num_speculative_tokens": 2}
    llm = LLM(tiny_gguf, max_model_len=256, tensor_parallel_size=2, speculative_config=spec)
    assert _tokens(llm) == want
    assert llm.engine.counters.spec.num_draft_tokens > 0
    llm.shutdown()


@needs_two_cores
@pytest.mark.skipif(load_qgemm() is None, reason="the shared-memory channel is in the native kernels")
def test_the_gloo_transport_gives_the_shared_memory_output(tiny_llama, monkeypatch):
    """Ranks on different machines talk over gloo only (here forced, on one machine): the same tokens."""
    shm = LLM(tiny_llama, max_model_len=256, tensor_parallel_size=2, speculative_config=NGRAM)
    assert shm.engine.runner.group.transport == "shm"
    want = _tokens(shm)
    shm.shutdown()
    monkeypatch.setenv("VERISPEC_TP_TRANSPORT", "gloo")
    gloo = LLM(tiny_llama, max_model_len=256, tensor_parallel_size=2, speculative_config=NGRAM)
    assert gloo.engine.runner.group.transport == "gloo"
    assert _tokens(gloo) == want
    gloo.shutdown()


@needs_two_cores
def test_shutdown_ends_the_ranks_and_a_dead_rank_is_an_error_not_a_hang(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=256, tensor_parallel_size=2)
    procs = llm.engine.runner.workers.procs
    _tokens(llm)
    llm.shutdown()
    assert [p.returncode for p in procs] == [0]
    llm = LLM(tiny_llama, max_model_len=256, tensor_parallel_size=2)
    worker = llm.engine.runner.workers.procs[0]
    worker.kill()
    worker.wait()
    with pytest.raises(RuntimeError, match="a peer process stopped responding"):
        _tokens(llm)
    llm.shutdown()


@needs_two_cores
def test_each_rank_runs_on_its_own_cores_and_rank_0_is_unbound_at_shutdown(tiny_llama, monkeypatch, caplog):
    """VERISPEC_CPU_BIND's default puts the two ranks on disjoint cores (this VM: one NUMA node, a core each), and
    the log says where; the engine's own process gets its cores back at shutdown; `none` binds nothing; the tokens
    are the same."""
    allowed = os.sched_getaffinity(0)
    with caplog.at_level(logging.INFO, logger="verispec.engine.builder"):
        llm = LLM(tiny_llama, max_model_len=256, tensor_parallel_size=2)
    mine, theirs = os.sched_getaffinity(0), os.sched_getaffinity(llm.engine.runner.workers.procs[0].pid)
    assert mine and theirs and not mine & theirs and mine | theirs <= allowed
    share = len(allowed) // 2
    placed = f"rank 0: {cpulist(mine)} x{min(share, len(mine))} | rank 1: {cpulist(theirs)} x{min(share, len(theirs))}"
    assert f"2 ranks on this machine, cores and threads {placed}" in caplog.text
    want = _tokens(llm)
    llm.shutdown()
    assert os.sched_getaffinity(0) == allowed
    monkeypatch.setenv("VERISPEC_CPU_BIND", "none")
    llm = LLM(tiny_llama, max_model_len=256, tensor_parallel_size=2)
    assert os.sched_getaffinity(llm.engine.runner.workers.procs[0].pid) == allowed
    assert _tokens(llm) == want
    llm.shutdown()
    monkeypatch.setenv("VERISPEC_CPU_BIND", "0-1")
    with pytest.raises(ValueError, match="VERISPEC_CPU_BIND='0-1' gives 1 core list"):
        LLM(tiny_llama, max_model_len=256, tensor_parallel_size=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
        (dict(tensor_parallel_size=64), "tensor_parallel_size=64 is more ranks than"),
        (dict(tensor_parallel_size=2, distributed_init_method="udp://x"), "distributed_init_method must be"),
        (dict(tensor_parallel_size=2, device="cuda"), "device='cuda' is not supported"),
    ],
)
def test_bad_settings_fail_before_any_rank_starts(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama, max_model_len=256, **kwargs)


@needs_two_cores
def test_a_model_that_does_not_shard_and_a_sharded_draft_are_refused(tmp_path, tiny_llama, tiny_draft):
    # every rank takes a multiple of 32 MLP columns: 32 do not go round two ranks (both ranks fail their load)
    narrow = write_tiny_checkpoint(tmp_path / "narrow", "llama", num_layers=1, intermediate_size=32)
    with pytest.raises(ValueError, match="intermediate_size=32"):
        LLM(str(narrow), max_model_len=256, tensor_parallel_size=2)
    draft_tp = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2"):
        LLM(
            tiny_llama,
            tensor_parallel_size=2,
            speculative_config={**draft_tp, "draft_tensor_parallel_size": 2},
        )


@contextlib.contextmanager
def _headless_node(model: str, tmp_path, tp: int):
    """Node 1 of two (`verispec serve --headless --node-rank 1`) in a process of its own -> (the rendezvous for node
    0's engine, the process); killed on the way out."""
    method = f"tcp://127.0.0.1:{free_port()}"
    nodes = ["--tensor-parallel-size", str(tp), "--nnodes", "2", "--distributed-init-method", method]
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "verispec.server.cli", model, "--headless", "--node-rank", "1", *nodes],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield method, node1
        finally:
            node1.kill()


@needs_two_cores
def test_two_nodes_over_loopback(tiny_llama, tmp_path, monkeypatch):
    """Node 1 runs its rank headless (`verispec serve --headless`), node 0 the engine; gloo between them, as between
    two machines: plain decoding's output, and node 1 ends when node 0 shuts down."""
    monkeypatch.setenv("VERISPEC_TP_TRANSPORT", "gloo")
    with _headless_node(tiny_llama, tmp_path, tp=2) as (method, node1):
        llm = LLM(
            tiny_llama, max_model_len=256, tensor_parallel_size=2, nnodes=2, distributed_init_method=method
        )
        assert llm.engine.runner.workers.procs == [] and llm.engine.runner.group.transport == "gloo"
        local = LLM(tiny_llama, max_model_len=256, tensor_parallel_size=2)
        want = _tokens(local)
        local.shutdown()
        assert _tokens(llm) == want
        llm.shutdown()
        assert node1.wait(30) == 0


@needs_two_cores
@pytest.mark.skipif(load_qgemm() is None, reason="the shared-memory channel is in the native kernels")
def test_two_nodes_of_two_ranks_sum_on_shared_memory_within_each(tiny_llama, tmp_path):
    """TP=4 over two "nodes" on one machine: each node's two ranks sum on their own channel and the nodes over gloo
    (transport shm+gloo); with n-gram drafts the output is one node's plain TP=2 output (the tiny model is far from
    ties, so the summation orders do not show)."""
    # first: while an engine of ranks lives, this process is bound to its rank 0's cores
    want = _tokens_tp2(tiny_llama)
    with _headless_node(tiny_llama, tmp_path, tp=4) as (method, node1):
        args = dict(max_model_len=256, tensor_parallel_size=4, nnodes=2, distributed_init_method=method)
        llm = LLM(tiny_llama, speculative_config=NGRAM, **args)
        group = llm.engine.runner.group
        assert group.transport == "shm+gloo" and group.leaders is not None
        assert _tokens(llm) == want
        assert llm.engine.counters.spec.num_draft_tokens > 0
        llm.shutdown()
        assert node1.wait(30) == 0


def _tokens_tp2(model: str) -> list[list[int]]:
    llm = LLM(model, max_model_len=256, tensor_parallel_size=2)
    try:
        return _tokens(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tensor_parallel_size=2, nnodes=3), "nnodes must be a positive integer dividing"),
        (dict(tensor_parallel_size=2, nnodes=2), "nnodes=2 needs distributed_init_method"),
        (
            dict(tensor_parallel_size=2, nnodes=2, node_rank=1, distributed_init_method="tcp://127.0.0.1:1"),
            "start it with `verispec serve --headless`",
        ),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank must be an integer in 0..1"),
    ],
)
def test_node_settings_are_checked(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama, max_model_len=256, **kwargs)
