"""EAGLE-3 draft: vLLM's checkpoint format and the draft block against its formula written out with transformers'
rotary embedding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import write_tiny_eagle3
from verispec.engine.kv_cache import KVCache
from verispec.engine.model_runner import ModelRunner, RowInput
from verispec.models.eagle3 import load_eagle3


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(
    w: dict, cfg: dict, embeds: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv

    eps, n = cfg["rms_norm_eps"], embeds.shape[0]
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // heads
    m = {k.removeprefix("midlayer."): v for k, v in w.items()}
    s = states @ m["fc.weight"].T
    e, residual = _rms(embeds, m["input_layernorm.weight"], eps), s
    x = torch.cat([e, _rms(s, m["hidden_norm.weight"], eps)], -1)
    q = (x @ m["self_attn.q_proj.weight"].T).view(1, n, heads, hd).transpose(1, 2)
    k = (x @ m["self_attn.k_proj.weight"].T).view(1, n, kvh, hd).transpose(1, 2)
    v = (x @ m["self_attn.v_proj.weight"].T).view(1, n, kvh, hd).transpose(1, 2)
    rope = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    cos, sin = rope(v, torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = repeat_kv(k, heads // kvh), repeat_kv(v, heads // kvh)
    att = (q @ k.transpose(-1, -2)) / hd**0.5 + torch.full((n, n), float("-inf")).triu(1)
    o = (att.softmax(-1) @ v).transpose(1, 2).reshape(n, heads * hd) @ m["self_attn.o_proj.weight"].T
    r = o + residual
    normed = _rms(r, m["post_attention_layernorm.weight"], eps)
    gate, up = normed @ m["mlp.gate_proj.weight"].T, normed @ m["mlp.up_proj.weight"].T
    out = r + (torch.nn.functional.silu(gate) * up) @ m["mlp.down_proj.weight"].T
    return _rms(out, m["norm.weight"], eps), out


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
    ref_head, ref_state = _reference(load_file(str(folder / "model.safetensors")), cfg, embeds, states)
    torch.testing.assert_close(head_in, ref_head, atol=1e-4, rtol=0)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=0)


def test_draft_vocabulary_maps_through_d2t(tiny_llama, tmp_path):
    folder = write_tiny_eagle3(tmp_path / "e", Path(tiny_llama), draft_vocab=10)
    w = load_file(str(folder / "model.safetensors"))
    w["d2t"] = torch.arange(10) * 7  # draft id i is target id 8 i
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
