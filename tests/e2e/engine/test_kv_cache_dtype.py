"""kv_cache_dtype (vLLM's key): K and V stored in float16 or bfloat16. Speculation still changes nothing under every
storage type (greedy equality for a method without its own cache, a draft model paging its cache through the
target's, an EAGLE head with its own), the fused C layers and the module path store and read alike, the caches
hold the requested dtype ("auto": the model's, float16 under int8 activations), and a half-size cache holds twice
the blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import helpers
from verispec import LLM
from verispec.config import model_config_from_hf
from verispec.engine.args import EngineArgs
from verispec.kernels import ops
from verispec.kernels.build import int8_isa, load_qgemm
from verispec.loader.hf import read_hf_config
from verispec.runner.kv_cache import plan_cache

NARROW = ("float16", "bfloat16")
SP = helpers.greedy(24)


def run(model: str, kv: str, spec: dict | None = None, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, kv_cache_dtype=kv, speculative_config=spec, max_model_len=256, max_num_seqs=4, **kw)
    outs = llm.generate(helpers.prompts(4, seed=3), SP, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def cache_dtypes(llm: LLM) -> set[torch.dtype]:
    return {t.dtype for t in llm.engine.runner.cache.kv}


@pytest.mark.parametrize("kv", NARROW)
def test_speculation_changes_nothing_over_a_narrow_cache(tiny_llama, tiny_draft, tiny_eagle, kv):
    plain, llm = run(tiny_llama, kv)
    assert cache_dtypes(llm) == {getattr(torch, kv)}
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
        {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3},
        {"method": "eagle", "model": tiny_eagle, "num_speculative_tokens": 3},
    ):
        out, llm = run(tiny_llama, kv, spec)
        assert out == plain, spec["method"]
        drafter = getattr(llm.engine.proposer, "cache", None)
        if drafter is not None:
            assert {t.dtype for t in drafter.kv} == {getattr(torch, kv)}, spec["method"]


@pytest.mark.skipif(load_qgemm() is None, reason="the fused layers need the native kernels")
@pytest.mark.parametrize("kv", NARROW)
def test_fused_layers_and_module_path_store_and_read_alike(tiny_gguf, kv, monkeypatch):
    fused, llm = run(tiny_gguf, kv)
    assert llm.ckpt.model.fused is not None
    monkeypatch.setenv("VERISPEC_FUSED_LAYERS", "0")
    module, llm = run(tiny_gguf, kv)
    assert llm.ckpt.model.fused is None
    assert module == fused


@pytest.mark.parametrize("kv", NARROW)
def test_the_pytorch_path_reads_a_narrow_cache(tiny_llama, kv, monkeypatch):
    """Without the kernels (their ops declining), K/V are written through torch and widened on read."""
    monkeypatch.setattr(ops, "attention", lambda *a, **k: None)
    monkeypatch.setattr(ops, "write_kv", lambda *a, **k: False)
    plain, llm = run(tiny_llama, kv)
    assert cache_dtypes(llm) == {getattr(torch, kv)}
    spec, _ = run(tiny_llama, kv, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert spec == plain


def test_auto_is_the_models_dtype_and_float16_under_int8(tiny_gguf):
    assert cache_dtypes(run(tiny_gguf, "auto")[1]) == {torch.float32}
    if int8_isa() is not None:
        assert cache_dtypes(run(tiny_gguf, "auto", activation_dtype="int8")[1]) == {torch.float16}
        assert cache_dtypes(run(tiny_gguf, "float32", activation_dtype="int8")[1]) == {torch.float32}


def test_a_half_size_cache_holds_twice_the_blocks(tiny_llama):
    cfg = model_config_from_hf(read_hf_config(Path(tiny_llama)), tiny_llama)
    # a budget neither fills with max_num_seqs full-length sequences
    wide = plan_cache(cfg, 64, 256, 1 << 20, dtype_bytes=4)
    narrow = plan_cache(cfg, 64, 256, 1 << 20, dtype_bytes=2)
    assert narrow.num_blocks - 1 == 2 * (wide.num_blocks - 1) < 64 * 17


@pytest.mark.parametrize(
    ("value", "says"), [("fp8", "fp8 caches"), ("fp8_e4m3", "fp8 caches"), ("float64", "allowed")]
)
def test_unsupported_kv_cache_dtype_is_refused_by_name(value, says):
    with pytest.raises(ValueError, match="kv_cache_dtype") as err:
        EngineArgs(kv_cache_dtype=value)
    assert says in str(err.value) and "auto, float32, float16, bfloat16" in str(err.value)
