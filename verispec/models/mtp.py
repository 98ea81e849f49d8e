"""Multi-token prediction layers shipped inside the target checkpoint (`mtp`), MiMo's format as vLLM reads it.

MiMo (`MiMoForCausalLM`: Qwen2 blocks; config `num_nextn_predict_layers`) stores MTP layer i as
`model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}.weight` plus a Qwen2 block
(`self_attn.*`, `mlp.*`, `input_layernorm`, `post_attention_layernorm`). At draft position p, from the token x_{p+1}
and the target's final normed hidden state h_p:
    e = token_layernorm(embed(x_{p+1})) (zero at position 0),  s = hidden_layernorm(h_p)
    out = final_layernorm(block(input_proj(cat(s, e))))
and drafts argmax(target lm_head(out)); later drafts feed back `out`. With several MTP layers, this build drafts
every position with the first (one cache, one alignment; vLLM's note: DeepSeek exposes one layer anyway).
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.config import ModelConfig
from verispec.layers.attention import AttnContext
from verispec.layers.norm import RMSNorm
from verispec.layers.rotary import rope_cos_sin, rope_inv_freq
from verispec.models.decoder import PACKED_MODULES, DecoderLayer
from verispec.models.eagle import TargetHeadDraft


class MTPLayer(TargetHeadDraft):
    packed_modules_mapping = PACKED_MODULES

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.token_layernorm, self.hidden_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(cfg, 0)
        self.final_layernorm = RMSNorm(h, eps)
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling), persistent=False
        )

    def forward(
        self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, ctx: AttnContext, kv: list
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [N, H] of x_{p+1}, states [N, H] h_p, positions [S, Q] p -> (out, out): the LM head's input and
        the next state."""
        # [N, 1]
        at_zero = ctx.to_packed((positions == 0)[..., None].to(embeds.dtype)).view(-1, 1)
        e = self.token_layernorm.forward(embeds * (1 - at_zero))
        x = self.input_proj(torch.cat([self.hidden_layernorm.forward(states), e], dim=-1))
        rope = rope_cos_sin(positions, self.inv_freq, x.dtype)
        out = self.final_layernorm.forward(self.block.forward(x, (rope, rope), ctx, kv[0]))
        return out, out
