"""EAGLE-3 draft model (Li et al. 2025, https://arxiv.org/abs/2503.01840), in the checkpoint format vLLM reads.

The target's residual streams entering three layers (default 2, L // 2, L - 3) are concatenated per position and
fused by `fc` [H, 3 H_target] into the state; later drafts feed back the draft's own pre-norm state instead. One
decoder block reads the token's embedding and that state side by side:
    e = input_layernorm(embed(x_{p+1})),  s' = hidden_norm(s),  residual = s (s' with `norm_before_residual`)
    r = attn(cat(e, s')) + residual,  out = mlp(post_attention_layernorm(r)) + r
    draft = d2t-map(argmax(lm_head(norm(out)))),  feedback state = out
The draft vocabulary may be smaller than the target's: draft id i is target id i + d2t[i].

Checkpoint: an HF folder with a Llama-style config.json (`draft_vocab_size`, `target_hidden_size`,
`norm_before_residual`, `eagle_aux_hidden_state_layer_ids` at the top or in `eagle_config`) and safetensors
`fc.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2 H), `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` (when the vocabularies differ), optionally
`embed_tokens.weight` (else the target's embedding) and P-EAGLE's `mask_hidden` [3 H_target] (parallel drafting); `layers.0.` for `midlayer.` and a `model.` prefix are accepted.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.config import ModelConfig
from verispec.layers.attention import AttnContext
from verispec.layers.linear import Dense
from verispec.layers.norm import RMSNorm
from verispec.layers.rotary import rope_cos_sin, rope_inv_freq
from verispec.models.decoder import MLP, PACKED_MODULES, Attention


class Eagle3Draft(nn.Module):
    packed_modules_mapping = PACKED_MODULES

    def __init__(
        self,
        cfg: ModelConfig,
        target_hidden: int,
        draft_vocab: int,
        norm_before_residual: bool,
        own_embed: bool = False,
    ):
        super().__init__()
        self.cfg, h, eps = cfg, cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.fc = Dense(3 * target_hidden, h, bias=False)
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.self_attn = Attention(cfg, sliding=False)
        # q / k / v read the embedding and the state side by side: [2 H] in, the same shards out
        qkv = self.self_attn.qkv_proj
        self.self_attn.qkv_proj = Dense(2 * h, qkv.out_features, bias=cfg.attention_bias, shards=qkv.shards)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)
        self.norm = RMSNorm(h, eps)
        self.lm_head = Dense(h, draft_vocab, bias=False)
        # own embedding if the checkpoint has one, else the target's (bind_target)
        self.embed_tokens: nn.Embedding | None = None
        if own_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, h, _weight=torch.empty(cfg.vocab_size, h))
        # [1, state width] P-EAGLE: the state its masked rows read (loaded only for parallel drafting)
        self.register_buffer("mask_hidden", None)
        # [draft_vocab] target id - draft id
        self.register_buffer("d2t", None)
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling), persistent=False
        )

    def forward(
        self,
        # [N, H] embeddings of the tokens x_{p+1}
        embeds: torch.Tensor,
        # [N, 3 H_target] the target's three aux states, or [N, H] the draft's own
        states: torch.Tensor,
        # [S, Q]
        positions: torch.Tensor,
        ctx: AttnContext,
        # one cache entry
        kv: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the LM head's input [N, H] (normed), the state fed to the next draft position [N, H] (pre-norm))."""
        s = self.fc(states) if states.shape[-1] != self.cfg.hidden_size else states
        e = self.input_layernorm.forward(embeds)
        if self.norm_before_residual:
            s = residual = self.hidden_norm.forward(s)
        else:
            residual, s = s, self.hidden_norm.forward(s)
        rope = rope_cos_sin(positions, self.inv_freq, e.dtype)
        a = self.self_attn.forward(torch.cat([e, s], dim=-1), rope, ctx, kv[0])
        r, normed = self.post_attention_layernorm.add_forward(residual, a)
        out = r + self.mlp.forward(normed)
        return self.norm.forward(out), out

    def bind_target(self, target) -> None:
        """The target's embedding, unless the checkpoint has its own (plain attributes: not submodules)."""
        self._target_embed = target.embed

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._target_embed(ids) if self.embed_tokens is None else self.embed_tokens(ids)

    def draft_ids(self, head_in: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B] target token ids of the draft vocabulary's argmax."""
        ids = self.lm_head(head_in).argmax(dim=-1)
        return ids if self.d2t is None else ids + self.d2t[ids]

    def draft_topk(self, head_in: torch.Tensor, k: int) -> torch.Tensor:
        """[B, H] -> [B, k] target ids of the draft vocabulary's k best, best first (token trees)."""
        ids = self.lm_head(head_in).topk(k, dim=-1).indices
        return ids if self.d2t is None else ids + self.d2t[ids]

    def draft_logits(self, head_in: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B, V] the drafter's logits over the target vocabulary, -inf outside the draft vocabulary
        (sampled and dynamic trees)."""
        logits = self.lm_head(head_in)
        if self.d2t is None:
            return logits
        out = logits.new_full((logits.shape[0], self.cfg.vocab_size), float("-inf"))
        ids = torch.arange(logits.shape[1], device=logits.device)
        out[:, ids + self.d2t] = logits
        return out


def aux_layer_ids(hf: dict, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input streams EAGLE-3 reads: the checkpoint's, else vLLM's (2, L // 2, L - 3)."""
    key = "eagle_aux_hidden_state_layer_ids"
    nested = hf.get("eagle_config")
    if nested is not None and not isinstance(nested, dict):
        raise ValueError(f"EAGLE-3 config.json: eagle_config must be an object, got {type(nested).__name__}")
    ids = hf.get(key, (nested or {}).get(key))
    n = num_target_layers
    if ids is None:
        return (2, n // 2, n - 3)
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"EAGLE-3 config.json: {key} must be a list of layer indices, got {ids!r}")
    return tuple(ids)
