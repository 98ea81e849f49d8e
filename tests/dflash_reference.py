"""The DFlash draft written out from its formula (z-lab's reference: context K/V from hidden_norm(fc(target states))
concatenated in front of the block's own K/V in every layer, queries from the block only), with transformers' Qwen3
rotary embedding, on one sequence and without a KV cache."""

from __future__ import annotations

import torch


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def dflash_reference(
    w: dict, cfg: dict, context: torch.Tensor, embeds: torch.Tensor, causal: bool = False
) -> torch.Tensor:
    """w: the checkpoint's tensors; context [n, len(target layers) H]: the target's streams at positions 0..n-1;
    embeds [b, H]: the block's embeddings at positions n..n+b-1. -> the LM head's input [b, H] (normed)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb, repeat_kv

    eps, heads, kvh, hd = (
        cfg["rms_norm_eps"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    n, b = context.shape[0], embeds.shape[0]
    rope = Qwen3RotaryEmbedding(Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"}))
    # [1, n + b, hd]
    cos, sin = rope(embeds[None], torch.arange(n + b)[None])
    c = _rms(context @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    # block query i (position n + i) sees every context key and block keys 0..i (causal) or all of them
    visible = torch.ones(b, n + b, dtype=torch.bool)
    if causal:
        visible[:, n:] = torch.ones(b, b, dtype=torch.bool).tril()
    x = embeds
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        kv_in = torch.cat([c, h])
        q = _rms(
            (h @ w[p + "self_attn.q_proj.weight"].T).view(b, heads, hd), w[p + "self_attn.q_norm.weight"], eps
        )
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(n + b, kvh, hd)
        k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(n + b, kvh, hd)
        # [1, heads, len, hd]
        q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        q, _ = apply_rotary_pos_emb(q, q, cos[:, n:], sin[:, n:])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        k, v = repeat_kv(k, heads // kvh), repeat_kv(v, heads // kvh)
        att = ((q @ k.transpose(-1, -2)) / hd**0.5).masked_fill(~visible, float("-inf"))
        o = (att.softmax(-1) @ v)[0].transpose(0, 1).reshape(b, heads * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        normed = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = normed @ w[p + "mlp.gate_proj.weight"].T, normed @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps)
