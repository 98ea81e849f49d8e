"""The CUDA path's wiring, run on the CPU: with `cuda_ops.applies` true for CPU tensors, a bfloat16 model runs every
product, norm and attention through verispec/kernels/cuda_ops.py (its Triton kernels under Triton's interpreter),
with the masks, padded layouts, sliding windows and token trees the engine builds. Speculative greedy output must
equal plain output there as on the GPU (tests/unit/kernels/test_cuda_ops.py checks the kernels themselves there)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import BFLOAT16_SAFE_PROMPTS
from tests.tiny_models import write_tiny_eagle
from verispec import LLM, SamplingParams
from verispec.kernels import cuda_ops

TREE = "[(0,), (1,), (2,), (0, 0), (1, 0)]"


@pytest.fixture
def cuda_path(triton_interpreter, monkeypatch):
    """The CUDA layers on CPU tensors; -> the number of attention calls they served."""
    calls = {"attention": 0}
    attention = cuda_ops.attention

    def counted(*args):
        calls["attention"] += 1
        return attention(*args)

    monkeypatch.setattr(cuda_ops, "applies", lambda x: not torch.is_grad_enabled())
    monkeypatch.setattr(cuda_ops, "attention", counted)
    with warnings.catch_warnings():
        # numpy's overflow warnings on the interpreter's masked-out lanes
        warnings.simplefilter("ignore", RuntimeWarning)
        yield calls


def _greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(BFLOAT16_SAFE_PROMPTS, sp, use_tqdm=False)]


def _float32_greedy(model: str) -> list[list[int]]:
    """The same prompts on the CPU's own float32 path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_ops, "applies", lambda x: False)
        return _greedy(LLM(model, device="cpu", max_model_len=128, max_num_seqs=4))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chain_drafts_on_the_cuda_path(tiny_checkpoints, cuda_path, arch):
    """n-gram chains (Gemma 3: sliding-window layers and q / k norms on [S, H, Q, D] views)."""
    kw = dict(dtype="bfloat16", device="cpu", max_model_len=128, max_num_seqs=4)
    model = tiny_checkpoints[arch]
    reference = _greedy(LLM(model, **kw))
    # the path computes the model (these tiny models' float32 greedy tokens, far from ties)
    assert reference == _float32_greedy(model)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(model, speculative_config=spec, **kw)
    assert _greedy(llm) == reference
    assert llm.engine.counters.spec.num_draft_tokens > 0 and cuda_path["attention"] > 0


def test_token_tree_on_the_cuda_path(tiny_llama, tmp_path, cuda_path):
    """A tree whose accepted nodes sit apart in the cache: their attention sums as their chain's does."""
    eagle = str(write_tiny_eagle(tmp_path / "e", Path(tiny_llama), copy_hidden=True))
    kw = dict(dtype="bfloat16", device="cpu", max_model_len=128, max_num_seqs=4)
    reference = _greedy(LLM(tiny_llama, **kw))
    assert reference == _float32_greedy(tiny_llama)
    spec = {"method": "eagle", "model": eagle, "num_speculative_tokens": 2, "speculative_token_tree": TREE}
    llm = LLM(tiny_llama, speculative_config=spec, **kw)
    assert _greedy(llm) == reference
    assert llm.engine.counters.spec.num_accepted_tokens > 0 and cuda_path["attention"] > 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_cached_prefix_blocks_on_the_cuda_path(tiny_llama, cuda_path, kv_cache_dtype):
    """The Triton kernel reads a sequence's blocks through the block table: a prompt whose first blocks are another
    request's cached ones decodes as with the cache off (float16 blocks widened in the kernel)."""
    kw = dict(
        dtype="bfloat16", device="cpu", max_model_len=128, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype
    )
    shared = [(7 * i) % 50 + 3 for i in range(37)]
    prompts = [{"prompt_token_ids": shared + [4, 9]}, {"prompt_token_ids": shared + [12]}]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

    def run(**extra) -> tuple[list[list[int]], LLM]:
        llm = LLM(tiny_llama, **{**kw, **extra})
        llm.generate(prompts[:1], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)], llm

    with pytest.MonkeyPatch.context() as mp:
        # the CPU's own float32 path, far from ties on these prompts
        mp.setattr(cuda_ops, "applies", lambda x: False)
        reference, _ = run(dtype="float32", kv_cache_dtype="auto", enable_prefix_caching=False)
    assert run(enable_prefix_caching=False)[0] == reference
    cached, llm = run()
    assert cached == reference and llm.engine.counters.prefix_cache_hits >= 32
    spec_cached, _ = run(speculative_config=spec)
    assert spec_cached == reference and cuda_path["attention"] > 0
