"""extract_hidden_states: the target's states at chosen layers saved per request, in vLLM's connector format."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import EDGE_LENGTH_PROMPTS
from verispec import LLM, SamplingParams


def _llm(model: str, folder, layer_ids=(2, 0, 3), **kw) -> LLM:
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1}
    if layer_ids is not None:
        spec["draft_model_config"] = {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}
    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(folder)},
    }
    return LLM(model, max_model_len=128, speculative_config=spec, kv_transfer_config=kv, **kw)


def test_states_match_transformers_hidden_states(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    # on the CPU in float32, like the transformers reference
    llm = _llm(tiny_llama, tmp_path / "hs", device="cpu")
    outs = llm.generate(EDGE_LENGTH_PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    norm = llm.engine.runner.model.norm
    for out in outs:
        saved = load_file(out.kv_transfer_params["hidden_states_path"])
        ids = out.prompt_token_ids
        # max_tokens=1: exactly the prompt, as in vLLM
        assert saved["token_ids"].tolist() == ids
        # [T, 3 layers in the given order, H]
        states = saved["hidden_states"]
        assert states.shape == (len(ids), 3, 64)
        with torch.no_grad():
            # hf[i]: input of layer i
            hf = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(states[:, 0], hf[2][0], atol=1e-4, rtol=0)
        torch.testing.assert_close(states[:, 1], hf[0][0], atol=1e-4, rtol=0)
        # id 3 = num_layers: the stream after the last layer, before the final norm (hf[3] has the norm applied)
        torch.testing.assert_close(norm(states[:, 2]), hf[3][0], atol=1e-4, rtol=0)


def test_generated_tokens_chunked_prompts_and_plain_output(tiny_llama, tmp_path):
    plain = LLM(tiny_llama, max_model_len=128)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(EDGE_LENGTH_PROMPTS, sp, use_tqdm=False)]
    whole = _llm(tiny_llama, tmp_path / "a").generate(EDGE_LENGTH_PROMPTS, sp, use_tqdm=False)
    chunked = _llm(tiny_llama, tmp_path / "b", max_num_batched_tokens=8).generate(
        EDGE_LENGTH_PROMPTS, sp, use_tqdm=False
    )
    for out, out_c, tokens in zip(whole, chunked, expected):
        # nothing is speculated: the output is plain decoding's
        assert out.outputs[0].token_ids == tokens
        a = load_file(out.kv_transfer_params["hidden_states_path"])
        b = load_file(out_c.kv_transfer_params["hidden_states_path"])
        # every token the target processed: the prompt and each generated token but the last
        assert a["token_ids"].tolist() == out.prompt_token_ids + tokens[:-1] == b["token_ids"].tolist()
        torch.testing.assert_close(a["hidden_states"], b["hidden_states"], atol=1e-5, rtol=0)


def test_default_layers_are_eagle3s(tiny_llama, tmp_path):
    llm = _llm(tiny_llama, tmp_path / "hs", layer_ids=None)
    # (2, L // 2, L - 3) for 3 layers
    assert llm.engine.proposer.layer_ids == (2, 1, 0)
    out = llm.generate(EDGE_LENGTH_PROMPTS[:1], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert load_file(out.kv_transfer_params["hidden_states_path"])["hidden_states"].shape == (3, 3, 64)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"kv_transfer_config": None}, "needs kv_transfer_config"),
        (
            {"kv_transfer_config": {"kv_connector": "LMCacheConnectorV1"}},
            "kv_connector must be 'ExampleHiddenStatesConnector'",
        ),
        (
            {"kv_transfer_config": {"kv_connector": "ExampleHiddenStatesConnector", "kv_port": 1}},
            "unknown key",
        ),
        (
            {"kv_transfer_config": {"kv_connector": "ExampleHiddenStatesConnector"}},
            "shared_storage_path is required",
        ),
        (
            {
                "kv_transfer_config": {
                    "kv_connector": "ExampleHiddenStatesConnector",
                    "kv_role": "kv_consumer",
                    "kv_connector_extra_config": {"shared_storage_path": "x"},
                }
            },
            "kv_role",
        ),
        ({"layer_ids": [1, 7]}, r"\[7\] out of range: the target has 3 layers"),
    ],
)
def test_errors_name_the_key(tiny_llama, tmp_path, kw, match):
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": kw.get("layer_ids", [1])}},
    }
    kv = kw.get(
        "kv_transfer_config",
        {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        },
    )
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama, max_model_len=128, speculative_config=spec, kv_transfer_config=kv)


def test_kv_transfer_config_needs_the_extract_method(tiny_llama, tmp_path):
    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_connector_extra_config": {"shared_storage_path": "x"},
    }
    with pytest.raises(
        ValueError, match="only supported with speculative_config method 'extract_hidden_states'"
    ):
        LLM(tiny_llama, kv_transfer_config=kv)


def test_a_cached_prefix_is_saved_from_the_pool_beside_its_blocks(tiny_llama, tmp_path):
    """The second request on a prompt hits the prefix cache (its cached positions are not recomputed) and still
    saves every token's states: those of the cached positions kept beside their K/V blocks by the first."""
    prompt = {"prompt_token_ids": [(7 * i + 3) % 250 + 3 for i in range(45)]}
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    cached = _llm(tiny_llama, tmp_path / "on")
    first = cached.generate([prompt], sp, use_tqdm=False)[0]
    second = cached.generate([prompt], sp, use_tqdm=False)[0]
    # the prompt's two full blocks came from the cache
    assert cached.engine.counters.prefix_cache_hits == 32
    fresh = _llm(tiny_llama, tmp_path / "off", enable_prefix_caching=False).generate(
        [prompt], sp, use_tqdm=False
    )[0]
    a, b, c = (load_file(o.kv_transfer_params["hidden_states_path"]) for o in (first, second, fresh))
    assert a["token_ids"].tolist() == b["token_ids"].tolist() == c["token_ids"].tolist()
    assert b["hidden_states"].shape == c["hidden_states"].shape
    # the cached positions' states are the first request's, bitwise
    assert torch.equal(b["hidden_states"][:32], a["hidden_states"][:32])
    torch.testing.assert_close(b["hidden_states"], c["hidden_states"], atol=1e-5, rtol=0)
