"""EAGLE draft model (Li et al. 2024, https://arxiv.org/abs/2401.15077), EAGLE-1 checkpoints as vLLM reads them.

At draft position p the model reads the token x_{p+1} and the target's final normed hidden state h_p:
    f = fc(cat(embed(x_{p+1}), h_p))                (HASS checkpoints, `add_para_norm`: both RMS-normed first)
    f = decoder layers (Llama blocks; the first without its input norm), no final norm
and drafts argmax(target lm_head(f)). Later drafts feed back the draft token and the draft's own f. The embedding and
the LM head are the target's.

Checkpoint: an HF folder with a Llama-style config.json (`num_hidden_layers`, usually 1; `add_para_norm` for HASS)
and safetensors `fc.weight` [H, 2H] (`fc.bias` if present), `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.post_attention_layernorm.weight`,
`layers.{i}.input_layernorm.weight` for i > 0; an optional `model.` prefix and the speculators names
`fusion_fc.*` / `pre_lm_head_layernorm.weight` are accepted; `embed_tokens.weight` and `lm_head.weight` are ignored
(shared with the target, as vLLM does).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from verispec.config import ModelConfig, model_config_from_hf
from verispec.layers.attention import AttnContext
from verispec.layers.norm import RMSNorm
from verispec.layers.rotary import rope_cos_sin, rope_inv_freq
from verispec.loader.hf import load_hf_tensors, read_hf_config, require_weights
from verispec.models.decoder import DecoderLayer

SPECULATORS_NAMES = {"fusion_fc.weight": "fc.weight", "fusion_fc.bias": "fc.bias",
                     "pre_lm_head_layernorm.weight": "hidden_states_layernorm.weight"}  # fmt: skip


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


class EagleDraft(TargetHeadDraft):
    def __init__(self, cfg: ModelConfig, fc_bias: bool, para_norm: bool):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's first block reads fc's output as is
        self.para_norm = para_norm
        if para_norm:
            self.embedding_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_states_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling), persistent=False
        )

    def forward(
        self,
        embeds: torch.Tensor,  # [N, H] the target's embeddings of the tokens x_{p+1}
        hidden: torch.Tensor,  # [N, H] target (or draft) states h_p
        positions: torch.Tensor,  # [S, Q] RoPE positions p
        ctx: AttnContext,
        kv: list[torch.Tensor],  # the draft's cache, one entry per draft layer
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


def load_eagle(folder: str | Path, device: torch.device, dtype: torch.dtype) -> EagleDraft:
    folder = Path(folder)
    hf = read_hf_config(folder)
    # EAGLE checkpoints name their own architectures (LlamaForCausalLMEagle, ...): the blocks are Llama blocks
    cfg = model_config_from_hf({**hf, "architectures": ["LlamaForCausalLM"]}, str(folder / "config.json"))
    tensors = {}
    for name, value in load_hf_tensors(folder).items():
        name = name.removeprefix("model.")
        tensors[SPECULATORS_NAMES.get(name, name)] = value
    last = f"layers.{cfg.num_layers - 1}.mlp.down_proj.weight"
    require_weights(tensors, [last], folder, "EAGLE", f"says {cfg.num_layers} layers")
    draft = EagleDraft(cfg, fc_bias="fc.bias" in tensors, para_norm=bool(hf.get("add_para_norm", False)))

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"{folder}: EAGLE weight {name!r} is missing")
        return tensors[name]

    def put(param: torch.Tensor, name: str, value: torch.Tensor | None = None) -> None:
        value = take(name) if value is None else value
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{folder}: EAGLE weight {name!r} has shape {tuple(value.shape)}, expected "
                             f"{tuple(param.shape)}")  # fmt: skip
        with torch.no_grad():
            param.copy_(value.to(torch.float32))

    put(draft.fc.weight, "fc.weight")
    if draft.fc.bias is not None:
        put(draft.fc.bias, "fc.bias")
    if draft.para_norm:
        put(draft.embedding_layernorm.weight, "embedding_layernorm.weight")
        put(draft.hidden_states_layernorm.weight, "hidden_states_layernorm.weight")
    for i, layer in enumerate(draft.layers):
        p, at = f"layers.{i}.", layer.self_attn
        qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        bias = (
            torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if cfg.attention_bias else None
        )
        gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        try:
            at.qkv_proj.load(qkv.float(), None if bias is None else bias.float(), p + "self_attn.qkv_proj")
            at.o_proj.load(take(p + "self_attn.o_proj.weight").float(), None, p + "self_attn.o_proj.weight")
            layer.mlp.gate_up_proj.load(gate_up.float(), None, p + "mlp.gate_up_proj")
            layer.mlp.down_proj.load(
                take(p + "mlp.down_proj.weight").float(), None, p + "mlp.down_proj.weight"
            )
        except ValueError as e:
            raise ValueError(f"{folder}: {e}") from None
        if i > 0:
            put(layer.input_layernorm.weight, p + "input_layernorm.weight")
        put(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
    return draft.to(device=device, dtype=dtype).eval()
