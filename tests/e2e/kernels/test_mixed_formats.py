"""A GGUF whose projections mix quantized formats (Q4_K_M files keep v in another type than q and k) and whose
embedding is quantized: every projection stays quantized (q, k and v apart), the layers still run fused, the
embedding stays in its blocks, and the fused, module and speculative paths give the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import helpers
from verispec import LLM, SamplingParams
from verispec.kernels.qweight import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no kernel library here")

SP = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
KW = dict(device="cpu", max_model_len=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def mixed_gguf(tiny_llama, tmp_path_factory) -> str:
    from tests.tiny_models import write_tiny_gguf

    out = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    return str(write_tiny_gguf(Path(tiny_llama), out, "Q4_1", "Q8_0", v_type="Q8_0", embed_type="Q8_0"))


@pytest.mark.parametrize("activation_dtype", ["float32", "int8"])
def test_mixed_formats_stay_quantized_and_fused(mixed_gguf, activation_dtype, monkeypatch):
    prompts = helpers.prompts(4, 3)
    llm = LLM(mixed_gguf, activation_dtype=activation_dtype, **KW)
    model = llm.ckpt.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.qweight is None and len(qkv.qparts) == 3
    assert len({p.fmt for p in qkv.qparts}) == 2
    assert model.embed_tokens.qweight is not None and model.embed_tokens.weight.numel() == 0
    assert model.fused is not None
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, SP, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    fast = LLM(mixed_gguf, activation_dtype=activation_dtype, speculative_config=spec, **KW)
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, SP, use_tqdm=False)] == ref
    monkeypatch.setenv("VERISPEC_FUSED_LAYERS", "0")
    modules = LLM(mixed_gguf, activation_dtype=activation_dtype, **KW)
    assert modules.ckpt.model.fused is None
    assert [o.outputs[0].token_ids for o in modules.generate(prompts, SP, use_tqdm=False)] == ref
