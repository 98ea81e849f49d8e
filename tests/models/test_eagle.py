"""EAGLE-1 draft: vLLM's checkpoint format and the draft forward against transformers' Llama block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import write_tiny_eagle
from verispec.loader.drafts import load_eagle
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner, RowInput


def test_draft_forward_matches_transformers(tiny_llama, tmp_path):
    from transformers import LlamaConfig, LlamaModel

    folder = write_tiny_eagle(tmp_path / "e", Path(tiny_llama), num_layers=2, seed=3)
    draft = load_eagle(folder, torch.device("cpu"), torch.float32)
    cache = KVCache(draft.cfg, 2, 64, torch.device("cpu"), torch.float32)
    runner = ModelRunner(draft, cache, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    n, h = 7, draft.cfg.hidden_size
    embeds, hidden = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    _, positions, ctx, _ = runner.build_context([RowInput(1, 0, list(range(n)))])
    with torch.no_grad():
        # [n, H] each: EAGLE-1 feeds its features back
        ours, state = draft(
            embeds,
            hidden,
            positions,
            ctx,
            cache.kv,
        )
    assert ours is state

    w = load_file(str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    ref = LlamaModel(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})).eval()
    ref.load_state_dict({k: v for k, v in w.items() if k.startswith("layers.")}, strict=False)
    # EAGLE's first block has no input norm
    ref.layers[0].input_layernorm = torch.nn.Identity()
    # and the draft no final norm
    ref.norm = torch.nn.Identity()
    x = torch.cat([embeds, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
    with torch.no_grad():
        expected = ref(inputs_embeds=x[None]).last_hidden_state[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_speculators_names_and_model_prefix_load(tiny_llama, tmp_path):
    folder = write_tiny_eagle(tmp_path / "e", Path(tiny_llama))
    w = load_file(str(folder / "model.safetensors"))
    renamed = {("model." + k).replace("model.fc.", "fusion_fc."): v for k, v in w.items()}
    save_file(renamed, str(folder / "model.safetensors"))
    draft = load_eagle(folder, torch.device("cpu"), torch.float32)
    assert torch.equal(draft.fc.weight, w["fc.weight"]) and torch.equal(draft.fc.bias, w["fc.bias"])


def test_missing_weight_is_named(tiny_llama, tmp_path):
    folder = write_tiny_eagle(tmp_path / "e", Path(tiny_llama))
    w = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in w.items() if "o_proj" not in k}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="EAGLE weight .layers.0.self_attn.o_proj.weight. is missing"):
        load_eagle(folder, torch.device("cpu"), torch.float32)
