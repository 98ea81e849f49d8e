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
`embed_tokens.weight` (else the target's embedding); `layers.0.` for `midlayer.` and a `model.` prefix are accepted.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from verispec.config import ModelConfig, config_int, model_config_from_hf
from verispec.layers.attention import AttnContext
from verispec.layers.linear import Dense
from verispec.layers.norm import RMSNorm
from verispec.layers.rotary import rope_cos_sin, rope_inv_freq
from verispec.loader.hf import check_token_ids, load_hf_tensors, load_module_weights, read_hf_config
from verispec.models.decoder import MLP, Attention


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: ModelConfig, target_hidden: int, draft_vocab: int, norm_before_residual: bool):
        super().__init__()
        self.cfg, h, eps = cfg, cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.fc = Dense(3 * target_hidden, h, bias=False)
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.self_attn = Attention(cfg, sliding=False)
        self.self_attn.qkv_proj = Dense(2 * h, self.self_attn.qkv_proj.out_features, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)
        self.norm = RMSNorm(h, eps)
        self.lm_head = Dense(h, draft_vocab, bias=False)
        self.embed_tokens: nn.Embedding | None = None  # own embedding if the checkpoint has one
        self.register_buffer("d2t", None)  # [draft_vocab] target id - draft id
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling), persistent=False
        )

    def forward(
        self,
        embeds: torch.Tensor,  # [N, H] embeddings of the tokens x_{p+1}
        states: torch.Tensor,  # [N, 3 H_target] the target's three aux states, or [N, H] the draft's own
        positions: torch.Tensor,  # [S, Q]
        ctx: AttnContext,
        kv: list[torch.Tensor],  # one cache entry
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


def load_eagle3(
    folder: str | Path, device: torch.device, dtype: torch.dtype, target_hidden: int
) -> Eagle3Draft:
    folder = Path(folder)
    hf = read_hf_config(folder)
    cfg = model_config_from_hf({**hf, "architectures": ["LlamaForCausalLM"]}, str(folder / "config.json"))
    tensors = {}
    for name, value in load_hf_tensors(folder).items():
        name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
        tensors[name.removeprefix("midlayer.")] = value  # the block's weights sit at the top of Eagle3Draft
    tensors.pop("t2d", None)
    where = str(folder / "config.json")
    draft_vocab = config_int(hf.get("draft_vocab_size") or cfg.vocab_size, "draft_vocab_size", where)
    if draft_vocab > cfg.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size={draft_vocab} exceeds vocab_size={cfg.vocab_size}")
    th = config_int(hf.get("target_hidden_size") or target_hidden, "target_hidden_size", where)
    draft = Eagle3Draft(cfg, th, draft_vocab, bool(hf.get("norm_before_residual", False)))
    d2t = tensors.pop("d2t", None)
    if draft_vocab != cfg.vocab_size:
        if d2t is None or tuple(d2t.shape) != (draft_vocab,):
            raise ValueError(f"{folder}: draft_vocab_size={draft_vocab} < vocab_size={cfg.vocab_size} needs a 'd2t' "
                             f"tensor of {draft_vocab} offsets")  # fmt: skip
        check_token_ids(d2t, "d2t", draft_vocab, cfg.vocab_size, folder, offsets=True)
        draft.d2t = d2t.long()
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"{folder}: EAGLE-3 weight 'embed_tokens.weight' has shape {tuple(embed.shape)}, expected "
                         f"{(cfg.vocab_size, cfg.hidden_size)}")  # fmt: skip
    qkv = [tensors.pop(f"self_attn.{n}_proj.weight", None) for n in "qkv"]
    gate_up = [tensors.pop(f"mlp.{n}_proj.weight", None) for n in ("gate", "up")]
    for parts, fused in ((qkv, "self_attn.qkv_proj.weight"), (gate_up, "mlp.gate_up_proj.weight")):
        if all(p is not None for p in parts):
            tensors[fused] = torch.cat(parts)
    load_module_weights(draft, tensors, folder, "EAGLE-3")
    if embed is not None:
        draft.embed_tokens = nn.Embedding(*embed.shape, _weight=embed.float().clone())
    for dense in (
        draft.fc,
        draft.lm_head,
        draft.self_attn.qkv_proj,
        draft.self_attn.o_proj,
        draft.mlp.gate_up_proj,
        draft.mlp.down_proj,
    ):
        dense.pack()  # the weights were copied in place: refresh the packed copies
    return draft.to(device=device, dtype=dtype).eval()
