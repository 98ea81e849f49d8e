"""Medusa heads: the checkpoint format vLLM reads, the forward, and load errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import write_tiny_medusa
from verispec.loader.drafts import load_medusa
from verispec.models.medusa import MedusaConfig


def test_heads_compute_vllm_medusa(tiny_medusa):
    heads = load_medusa(tiny_medusa, torch.device("cpu"), torch.float32)
    w = load_file(str(Path(tiny_medusa) / "model.safetensors"))
    x = torch.randn(3, heads.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = []
    for h in range(5):
        # one residual layer
        y = x + torch.nn.functional.silu(x @ w[f"medusa_heads.blocks.{h}.layers.0.weight"].T)
        expected.append((y @ w[f"medusa_heads.lm_heads.{h}.weight"].T).argmax(-1))
    # [B, num_heads] drafts, head h at column h
    assert torch.equal(heads(x), torch.stack(expected, 1))


def test_config_key_aliases_and_defaults():
    cfg = MedusaConfig.from_hf({"hidden_size": 8, "vocab_size": 10, "num_heads": 3}, "x")
    assert (cfg.num_heads, cfg.num_hidden_layers, cfg.truncated_vocab_size, cfg.fc_bias) == (3, 1, 10, False)
    cfg = MedusaConfig.from_hf(
        {"hidden_size": 8, "vocab_size": 10, "medusa_num_heads": 2, "medusa_num_layers": 4}, "x"
    )
    assert (cfg.num_heads, cfg.num_hidden_layers) == (2, 4)
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig.from_hf({"hidden_size": 8, "vocab_size": 10}, "x")


def test_truncated_vocabulary_maps_back_through_token_map(tiny_llama, tmp_path):
    folder = write_tiny_medusa(tmp_path / "m", Path(tiny_llama), num_heads=2)
    w = load_file(str(folder / "model.safetensors"))
    token_map = torch.tensor([5, 9, 17, 40])
    for h in range(2):
        w[f"medusa_heads.lm_heads.{h}.weight"] = w[f"medusa_heads.lm_heads.{h}.weight"][:4].contiguous()
    save_file({**w, "token_map": token_map}, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "truncated_vocab_size": 4}))
    ids = load_medusa(folder, torch.device("cpu"), torch.float32)(torch.randn(6, cfg["hidden_size"]))
    assert torch.isin(ids, token_map).all()


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda cfg, w: (cfg, {k: v for k, v in w.items() if "lm_heads.1" not in k}),
            "'lm_heads.1.weight' is missing",
        ),
        (
            lambda cfg, w: (cfg, {**w, "medusa_heads.blocks.0.layers.0.weight": torch.zeros(3, 3)}),
            "has shape",
        ),
        (lambda cfg, w: ({**cfg, "model_type": "llama"}, w), "not a Medusa checkpoint"),
        (lambda cfg, w: ({**cfg, "truncated_vocab_size": 4}, w), "needs a 'token_map'"),
        (lambda cfg, w: ({**cfg, "hidden_size": "64"}, w), "positive integer hidden_size"),
    ],
)
def test_load_errors_name_the_problem(tiny_llama, tmp_path, edit, match):
    folder = write_tiny_medusa(tmp_path / "m", Path(tiny_llama), num_heads=2)
    cfg, w = edit(
        json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        load_medusa(folder, torch.device("cpu"), torch.float32)
