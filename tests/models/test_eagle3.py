"""EAGLE-3 draft: vLLM's checkpoint format and the draft block against its formula written out with transformers'
rotary embedding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.eagle3_reference import eagle3_reference
from tests.tiny_models import write_tiny_eagle3
from verispec.loader.drafts import load_eagle3
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner, RowInput


def test_draft_block_matches_its_formula(tiny_llama, tmp_path):
    folder = write_tiny_eagle3(tmp_path / "e", Path(tiny_llama), seed=5)
    cfg = json.loads((folder / "config.json").read_text())
    draft = load_eagle3(folder, torch.device("cpu"), torch.float32, cfg["hidden_size"])
    cache = KVCache(draft.cfg, 1, 64, torch.device("cpu"), torch.float32)
    _, positions, ctx, _ = ModelRunner(draft, cache, torch.device("cpu")).build_context(
        [RowInput(0, 0, [0] * 6)]
    )
    g = torch.Generator().manual_seed(1)
    embeds, states = torch.randn(6, 64, generator=g), torch.randn(6, 3 * 64, generator=g)
    with torch.no_grad():
        head_in, state = draft(embeds, states, positions, ctx, cache.kv)
    ref_head, ref_state = eagle3_reference(
        load_file(str(folder / "model.safetensors")), cfg, embeds, list(states)
    )
    torch.testing.assert_close(head_in, ref_head, atol=1e-4, rtol=0)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=0)


def test_draft_vocabulary_maps_through_d2t(tiny_llama, tmp_path):
    folder = write_tiny_eagle3(tmp_path / "e", Path(tiny_llama), draft_vocab=10)
    w = load_file(str(folder / "model.safetensors"))
    # draft id i is target id 8 i
    w["d2t"] = torch.arange(10) * 7
    save_file(w, str(folder / "model.safetensors"))
    draft = load_eagle3(folder, torch.device("cpu"), torch.float32, 64)
    ids = draft.draft_ids(torch.randn(50, 64))
    assert ((ids % 8) == 0).all() and (ids < 80).all()


def test_missing_d2t_is_named(tiny_llama, tmp_path):
    folder = write_tiny_eagle3(tmp_path / "e", Path(tiny_llama), draft_vocab=10)
    w = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in w.items() if k != "d2t"}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="draft_vocab_size=10 < vocab_size=320 needs a 'd2t'"):
        load_eagle3(folder, torch.device("cpu"), torch.float32, 64)
