"""EAGLE draft model (Li et al. 2024, https://arxiv.org/abs/2401.15077), EAGLE-1 checkpoints as vLLM reads them.

At draft position p the model reads the token x_{p+1} and the target's final normed hidden state h_p:
    f = fc(cat(embed(x_{p+1}), h_p))                (HASS checkpoints, `add_para_norm`: both RMS-normed first)
    f = decoder layers (Llama blocks; the first without its input norm), no final norm
and drafts argmax(target lm_head(f)). Later drafts feed back the draft token and the draft's own f. The embedding and
the LM head are the target's.

Checkpoint: an HF folder with a Llama-style config.json (`num_hidden_layers`, usually 1; `add_para_norm` for HASS)
and safetensors `fc.weight` [H, 2H] (`fc.bias` if present), `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.post_attention_layernorm.weight`,
`layers.{i}.input_layernorm.weight` for i > 0; P-EAGLE checkpoints add `mask_hidden` [H] (read only with parallel_drafting); an optional `model.` prefix and the speculators names
`fusion_fc.*` / `pre_lm_head_layernorm.weight` are accepted; `embed_tokens.weight` and `lm_head.weight` are ignored
(shared with the target, as vLLM does).
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.config import ModelConfig
from verispec.layers.attention import AttnContext
from verispec.layers.norm import RMSNorm
from verispec.layers.rotary import rope_cos_sin, rope_inv_freq
from verispec.models.decoder import PACKED_MODULES, DecoderLayer

SPECULATORS_NAMES = {
    "fusion_fc.weight": "fc.weight",
    "fusion_fc.bias": "fc.bias",
    "pre_lm_head_layernorm.weight": "hidden_states_layernorm.weight",
}


class TargetHeadDraft(nn.Module):
    """A drafter that embeds with the target's embedding and drafts through the target's LM head (EAGLE-1, MTP)."""

    def bind_target(self, target) -> None:
        """The target's embedding and LM head (plain attributes: not submodules)."""
        self._target_embed, self._target_logits = target.embed, target.compute_logits

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._target_embed(ids)

    def draft_ids(self, head_in: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B] the target LM head's argmax."""
        return self._target_logits(head_in).argmax(dim=-1)

    def draft_topk(self, head_in: torch.Tensor, k: int) -> torch.Tensor:
        """[B, H] -> [B, k] the k most likely tokens, best first (token trees)."""
        return self._target_logits(head_in).topk(k, dim=-1).indices

    def draft_logits(self, head_in: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B, V] the drafter's logits over the target vocabulary (sampled and dynamic trees)."""
        return self._target_logits(head_in)


class EagleDraft(TargetHeadDraft):
    packed_modules_mapping = PACKED_MODULES

    def __init__(self, cfg: ModelConfig, fc_bias: bool, para_norm: bool):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        # EAGLE's first block reads fc's output as is
        self.layers[0].input_layernorm = nn.Identity()
        self.para_norm = para_norm
        if para_norm:
            self.embedding_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_states_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        # [1, state width] P-EAGLE: the state its masked rows read (loaded only for parallel drafting)
        self.register_buffer("mask_hidden", None)
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling), persistent=False
        )

    def forward(
        self,
        # [N, H] the target's embeddings of the tokens x_{p+1}
        embeds: torch.Tensor,
        # [N, H] target (or draft) states h_p
        hidden: torch.Tensor,
        # [S, Q] RoPE positions p
        positions: torch.Tensor,
        ctx: AttnContext,
        # the draft's cache, one entry per draft layer
        kv: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (features [N, H], the same features: EAGLE-1 feeds the LM head's input back as the next state)."""
        if self.para_norm:
            embeds, hidden = (
                self.embedding_layernorm.forward(embeds),
                self.hidden_states_layernorm.forward(hidden),
            )
        h = self.fc(torch.cat([embeds, hidden], dim=-1))
        rope = rope_cos_sin(positions, self.inv_freq, h.dtype)
        for layer, cache in zip(self.layers, kv):
            h = layer.forward(h, (rope, rope), ctx, cache)
        return h, h
