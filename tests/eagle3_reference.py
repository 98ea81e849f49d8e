"""The EAGLE-3 draft block written out from its formula (transformers' rotary embedding), one entry at a time, so that
an entry may feed back the previous entry's output as its state (the draft's chain) instead of the target's."""

from __future__ import annotations

import torch


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def eagle3_reference(
    w: dict, cfg: dict, embeds: torch.Tensor, states: list[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries 0..n-1 at positions 0..n-1, causal attention. w: the checkpoint's tensors; embeds [n, H]; states[i]:
    the target's three streams [3 H] for entry i, or None: entry i - 1's output (feedback).
    -> (LM head inputs [n, H] (normed), outputs [n, H] (pre-norm))."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv

    eps, n = cfg["rms_norm_eps"], embeds.shape[0]
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // heads
    m = {k.removeprefix("midlayer."): v for k, v in w.items()}
    rope = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    # [1, n, hd]
    cos, sin = rope(embeds[None], torch.arange(n)[None])
    keys, values, heads_in, outs = [], [], [], []
    for i in range(n):
        s = outs[-1] if states[i] is None else states[i] @ m["fc.weight"].T
        e, residual = _rms(embeds[i], m["input_layernorm.weight"], eps), s
        x = torch.cat([e, _rms(s, m["hidden_norm.weight"], eps)], -1)
        q = (x @ m["self_attn.q_proj.weight"].T).view(1, heads, 1, hd)
        k = (x @ m["self_attn.k_proj.weight"].T).view(1, kvh, 1, hd)
        v = (x @ m["self_attn.v_proj.weight"].T).view(1, kvh, 1, hd)
        q, k = apply_rotary_pos_emb(q, k, cos[:, i : i + 1], sin[:, i : i + 1])
        keys.append(k)
        values.append(v)
        # [1, heads, i + 1, hd]
        kk = repeat_kv(torch.cat(keys, 2), heads // kvh)
        vv = repeat_kv(torch.cat(values, 2), heads // kvh)
        att = (q @ kk.transpose(-1, -2)) / hd**0.5
        o = (att.softmax(-1) @ vv).reshape(heads * hd) @ m["self_attn.o_proj.weight"].T
        r = o + residual
        normed = _rms(r, m["post_attention_layernorm.weight"], eps)
        gate, up = normed @ m["mlp.gate_proj.weight"].T, normed @ m["mlp.up_proj.weight"].T
        outs.append(r + (torch.nn.functional.silu(gate) * up) @ m["mlp.down_proj.weight"].T)
        heads_in.append(_rms(outs[-1], m["norm.weight"], eps))
    return torch.stack(heads_in), torch.stack(outs)
