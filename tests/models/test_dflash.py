"""DFlash draft: z-lab's / vLLM's checkpoint format, the block forward against its formula written out, and the
config.json settings (target layers, block size, attention pattern) with their errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.dflash_reference import dflash_reference
from tests.tiny_models import write_tiny_dflash
from verispec.config import model_config_from_hf
from verispec.loader.drafts import load_dflash
from verispec.loader.hf import read_hf_config
from verispec.models.dflash import build_target_layer_ids, dflash_config
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner, RowInput

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target_cfg(tiny_llama):
    return model_config_from_hf(read_hf_config(Path(tiny_llama)))


def _edit(folder: Path, config=None, tensors=None) -> Path:
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config(cfg)))
    if tensors:
        save_file(tensors(load_file(str(folder / "model.safetensors"))), str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("causal", [False, True])
def test_block_matches_its_formula(tiny_llama, target_cfg, tmp_path, causal):
    """Context K/V written in two chunks (as prompt chunks arrive), then one block forward: the same hidden states
    as the formula recomputed in one piece, with bidirectional (DFlash's default) or causal attention in the block."""
    folder = write_tiny_dflash(tmp_path / "d", Path(tiny_llama), seed=3)
    if causal:
        _edit(folder, config=lambda c: {**c, "dflash_config": {**c["dflash_config"], "causal": True}})
    cfg = json.loads((folder / "config.json").read_text())
    draft = load_dflash(folder, CPU, torch.float32, target_cfg)
    assert draft.dflash.causal is causal
    cache = KVCache(draft.cfg, 2, 64, CPU, torch.float32)
    runner = ModelRunner(draft, cache, CPU)
    g = torch.Generator().manual_seed(1)
    # slot 1; context positions 0..8, block positions 9..13
    n, b = 9, 5
    context, embeds = torch.randn(n, 2 * 64, generator=g), torch.randn(b, 64, generator=g)
    with torch.no_grad():
        for lo, hi in ((0, 4), (4, n)):
            _, positions, ctx, _ = runner.build_context([RowInput(1, lo, [0] * (hi - lo))])
            draft.write_context(context[lo:hi], positions, ctx, cache.kv)
        block = None if causal else torch.ones(b, b, dtype=torch.bool)
        _, positions, ctx, _ = runner.build_context([RowInput(1, n, [0] * b, tree_mask=block)])
        out = draft(embeds, positions, ctx, cache.kv)
    ref = dflash_reference(load_file(str(folder / "model.safetensors")), cfg, context, embeds, causal)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_weights_load_under_their_checkpoint_names(tiny_llama, target_cfg, tmp_path):
    """Every checkpoint tensor lands in its module (k / v fused into kv_proj, gate / up into gate_up_proj); a
    `model.` prefix and `midlayer.` for layer 0 are read too."""
    folder = write_tiny_dflash(tmp_path / "d", Path(tiny_llama), num_layers=1)
    w = load_file(str(folder / "model.safetensors"))
    draft = load_dflash(folder, CPU, torch.float32, target_cfg)
    attn, mlp = draft.layers[0].self_attn, draft.layers[0].mlp
    pairs = {
        "fc.weight": draft.fc.weight,
        "hidden_norm.weight": draft.hidden_norm.weight,
        "norm.weight": draft.norm.weight,
        "layers.0.self_attn.q_proj.weight": attn.q_proj.weight,
        "layers.0.self_attn.o_proj.weight": attn.o_proj.weight,
        "layers.0.self_attn.q_norm.weight": attn.q_norm.weight,
        "layers.0.self_attn.k_norm.weight": attn.k_norm.weight,
        "layers.0.mlp.down_proj.weight": mlp.down_proj.weight,
        "layers.0.input_layernorm.weight": draft.layers[0].input_layernorm.weight,
    }
    for name, param in pairs.items():
        torch.testing.assert_close(param.detach(), w[name], rtol=0, atol=0)
    kv = torch.cat([w["layers.0.self_attn.k_proj.weight"], w["layers.0.self_attn.v_proj.weight"]])
    torch.testing.assert_close(attn.kv_proj.weight.detach(), kv, rtol=0, atol=0)
    gate_up = torch.cat([w["layers.0.mlp.gate_proj.weight"], w["layers.0.mlp.up_proj.weight"]])
    torch.testing.assert_close(mlp.gate_up_proj.weight.detach(), gate_up, rtol=0, atol=0)
    # the target's embedding and LM head
    assert draft.embed_tokens is None and draft.lm_head is None and draft.d2t is None
    renamed = {"model." + k.replace("layers.0.", "midlayer."): v for k, v in w.items()}
    other = load_dflash(_edit(folder, tensors=lambda _: renamed), CPU, torch.float32, target_cfg)
    torch.testing.assert_close(other.layers[0].self_attn.kv_proj.weight, attn.kv_proj.weight, rtol=0, atol=0)


@pytest.mark.parametrize(
    "drop, match",
    [
        ("layers.1.self_attn.k_norm.weight", "DFlash weight 'layers.1.self_attn.k_norm.weight' is missing"),
        ("layers.0.self_attn.v_proj.weight", "DFlash weight 'layers.0.self_attn.v_proj.weight' is missing"),
        ("hidden_norm.weight", "DFlash weight 'hidden_norm.weight' is missing"),
        ("fc.weight", "DFlash weight 'fc.weight' is missing"),
    ],
)
def test_a_missing_tensor_is_named(tiny_llama, target_cfg, tmp_path, drop, match):
    folder = _edit(
        write_tiny_dflash(tmp_path / "d", Path(tiny_llama)),
        tensors=lambda w: {k: v for k, v in w.items() if k != drop},
    )
    with pytest.raises(ValueError, match=match):
        load_dflash(folder, CPU, torch.float32, target_cfg)


def test_misshapen_tensors_are_named(tiny_llama, target_cfg, tmp_path):
    three = write_tiny_dflash(tmp_path / "a", Path(tiny_llama), target_layer_ids=[0, 1, 2])
    # fc reads three streams, the config names two target layers
    two = _edit(
        three, config=lambda c: {**c, "dflash_config": {**c["dflash_config"], "target_layer_ids": [0, 2]}}
    )
    with pytest.raises(
        ValueError, match=r"'fc.weight' has shape \(64, 192\) but 2 target layers .* need \(64, 128\)"
    ):
        load_dflash(two, CPU, torch.float32, target_cfg)
    q = _edit(
        write_tiny_dflash(tmp_path / "b", Path(tiny_llama)),
        tensors=lambda w: {**w, "layers.0.self_attn.q_proj.weight": torch.zeros(8, 64)},
    )
    with pytest.raises(ValueError, match=r"'layers.0.self_attn.q_proj.weight' has shape \(8, 64\), expected"):
        load_dflash(q, CPU, torch.float32, target_cfg)


def test_target_layers_and_block_size_from_config():
    """target_layer_ids are layer outputs (aux id j + 1, vLLM's conversion); vLLM's own key is taken as is; without
    either, z-lab's spread (the Qwen3-8B-DFlash-b16 layers for 36 target and 5 draft layers)."""
    base = {
        "num_hidden_layers": 5,
        "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 9, 17, 25, 33]},
    }
    c = dflash_config({**base, "block_size": 16}, 36)
    assert (c.aux_layers, c.block_size, c.causal) == ((2, 10, 18, 26, 34), 16, False)
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(28, 1) == [14]
    assert dflash_config({"num_hidden_layers": 5, "num_target_layers": 36}, 36).aux_layers == (
        2,
        10,
        18,
        26,
        34,
    )
    assert dflash_config({**base, "eagle_aux_hidden_state_layer_ids": [0, 3, 36]}, 36).aux_layers == (
        0,
        3,
        36,
    )
    nested = {**base, "block_size": 16, "dflash_config": {**base["dflash_config"], "block_size": 4}}
    assert dflash_config(nested, 36).block_size == 4
    assert dflash_config({**base, "is_causal": True}, 36).causal
    causal = {**base, "dflash_config": {**base["dflash_config"], "causal": True}}
    assert dflash_config({**causal, "is_causal": None}, 36).causal
    assert not dflash_config({**causal, "is_causal": False}, 36).causal


@pytest.mark.parametrize(
    "hf, match",
    [
        ({"dflash_config": [1]}, "dflash_config must be an object"),
        (
            {"dflash_config": {"target_layer_ids": [0, 3]}},
            r"target_layer_ids \[0, 3\] must be increasing ids in 0..2",
        ),
        ({"dflash_config": {"target_layer_ids": [2, 1]}}, r"target_layer_ids \[2, 1\] must be increasing"),
        ({"dflash_config": {"target_layer_ids": "0,1"}}, "target_layer_ids must be a non-empty list"),
        (
            {"eagle_aux_hidden_state_layer_ids": [0, 4]},
            r"eagle_aux_hidden_state_layer_ids \[0, 4\] must be .* 0..3",
        ),
        ({"block_size": 1}, "'block_size' must be an integer >= 2"),
        (
            {"dflash_config": {"use_swa": True}},
            "use_swa=True: this build runs DFlash drafts with full attention",
        ),
        (
            {"layer_types": ["sliding_attention"]},
            "layer_types=.*this build runs DFlash drafts with full attention",
        ),
        ({"dflash_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state=False"),
    ],
)
def test_config_errors_name_the_key(hf, match):
    with pytest.raises(ValueError, match=match):
        dflash_config({"num_hidden_layers": 2, **hf}, 3)


def test_mask_embedding_replaces_the_mask_tokens_row(tiny_llama, target_cfg, tmp_path):
    """A checkpoint's `mask_embedding` (vLLM reads it from mask_embedding.pt) is the mask token's embedding; the
    other tokens keep the target's rows."""
    folder = write_tiny_dflash(tmp_path / "d", Path(tiny_llama), mask_token_id=7)
    vec = torch.arange(64.0)
    _edit(folder, tensors=lambda w: {**w, "mask_embedding": vec[None]})
    draft = load_dflash(folder, CPU, torch.float32, target_cfg)
    table = torch.nn.Embedding(320, 64)
    draft.bind_target(SimpleNamespace(embed_tokens=table, lm_head=table), mask_token=7)
    ids = torch.tensor([3, 7, 9, 7])
    with torch.no_grad():
        e = draft.embed(ids)
        torch.testing.assert_close(e[[1, 3]], torch.stack([vec, vec]))
        torch.testing.assert_close(e[[0, 2]], table(ids[[0, 2]]))


def test_unreadable_mask_embedding_and_dflash2_are_refused(tiny_llama, target_cfg, tmp_path):
    pickle = write_tiny_dflash(tmp_path / "a", Path(tiny_llama))
    (pickle / "mask_embedding.pt").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="mask_embedding.pt is a pickle, which this build does not load"):
        load_dflash(pickle, CPU, torch.float32, target_cfg)
    short = _edit(
        write_tiny_dflash(tmp_path / "b", Path(tiny_llama)),
        tensors=lambda w: {**w, "mask_embedding": torch.ones(3)},
    )
    with pytest.raises(ValueError, match="'mask_embedding' must hold 64 floats"):
        load_dflash(short, CPU, torch.float32, target_cfg)
    selector = _edit(
        write_tiny_dflash(tmp_path / "c", Path(tiny_llama)),
        tensors=lambda w: {**w, "candidate_selector.hidden_projection.weight": torch.ones(4, 64)},
    )
    with pytest.raises(ValueError, match="belongs to a DFlash2 draft"):
        load_dflash(selector, CPU, torch.float32, target_cfg)
