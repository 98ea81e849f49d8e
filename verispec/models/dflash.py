"""DFlash draft model (block diffusion drafting, z-lab https://github.com/z-lab/dflash), in the checkpoint format vLLM
reads.

The target's residual streams after some of its layers (`dflash_config.target_layer_ids`; id j is the output of
layer j, the stream entering layer j + 1) are concatenated per position and fused into one context state:
    c = hidden_norm(fc(cat(streams)))
Each draft layer turns c into context keys and values with its own k / v projections (then k_norm and RoPE at the
context position; no input norm), written once into the draft's KV cache. A step then runs one forward over a block:
the newest committed token followed by K mask tokens (`dflash_config.mask_token_id`) at positions end .. end + K.
Queries come from the block alone; every block token attends to all context positions and to every block token
(non-causal inside the block, unless the config says `causal`):
    x = embed(block);  per layer: x = x + attn(input_layernorm(x)),  x = x + mlp(post_attention_layernorm(x))
    drafts = argmax(lm_head(norm(x)))[1:]
so one forward gives K drafts. The block the checkpoint was trained with (`block_size`) bounds K to block_size - 1.

Checkpoint: an HF folder, config.json with Qwen3 fields plus `block_size`, `dflash_config` {`mask_token_id`,
`target_layer_ids`, optional `block_size`, `causal`} (or vLLM's `eagle_aux_hidden_state_layer_ids`, in aux-id
terms), safetensors `fc.weight` [H, n H_target], `hidden_norm.weight`, `norm.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight` (+ `.bias` with `attention_bias`), `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.{input_layernorm,post_attention_layernorm}.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`;
optionally `embed_tokens.weight`, `lm_head.weight` and `d2t` (else the target's embedding and LM head) and
`mask_embedding` [H] (vLLM's mask_embedding.pt, kept in safetensors: pickles are not read). A `model.`
prefix, `midlayer.` for `layers.0.` and `encoder.{fc,output_norm_enc}.` are accepted, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from verispec.config import ModelConfig, config_int
from verispec.kernels import ops
from verispec.layers.attention import AttnContext, attention, read_kv, write_kv
from verispec.layers.linear import Dense
from verispec.layers.norm import RMSNorm
from verispec.layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq
from verispec.models.decoder import MLP

# k / v are fused (the context pass needs them without q); gate / up as in the decoder
PACKED_MODULES = {
    "k_proj": ("kv_proj", "k"),
    "v_proj": ("kv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# vLLM's renames of other exporters' tensor names
_RENAMES = (("midlayer.", "layers.0."), ("encoder.output_norm_enc.", "hidden_norm."), ("encoder.fc.", "fc."))
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class DFlashConfig:
    """The DFlash settings of a draft checkpoint's config.json."""

    block_size: int
    # target aux ids (engine terms: id i is the stream entering layer i), increasing
    aux_layers: tuple[int, ...]
    # attention inside the block: causal, or every block token sees every other (DFlash's default)
    causal: bool


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys and values come from two sources: the context state c (write_context) and the
    block's own tokens (forward); queries from the block only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, self.hq, self.hkv, self.d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kv = self.hkv * self.d
        bias = cfg.attention_bias
        self.q_proj = Dense(h, self.hq * self.d, bias=bias)
        self.kv_proj = Dense(h, 2 * kv, bias=bias, shards={"k": kv, "v": kv})
        self.o_proj = Dense(self.hq * self.d, h, bias=bias)
        self.q_norm, self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps), RMSNorm(self.d, cfg.rms_norm_eps)
        self.scale = self.d**-0.5

    def _kv(self, x: torch.Tensor, rope, ctx: AttnContext) -> torch.Tensor:
        """x [N, H] packed -> K|V [S, 2 Hkv, Q, D], K normed and rotated."""
        kv = ctx.to_padded(self.kv_proj.forward(x))
        s, nq = kv.shape[0], kv.shape[1]
        kv = kv.view(s, nq, 2 * self.hkv, self.d).transpose(1, 2)
        k = apply_rope(self.k_norm.forward(kv[:, : self.hkv]), *rope)
        return torch.cat((k, kv[:, self.hkv :]), dim=1)

    def write_context(self, c: torch.Tensor, rope, ctx: AttnContext, kv_cache: torch.Tensor) -> None:
        """Context K/V of c [N, H] into the cache at ctx's positions."""
        write_kv(kv_cache, ctx, self._kv(c, rope, ctx))

    def forward(self, x: torch.Tensor, rope, ctx: AttnContext, kv_cache: torch.Tensor) -> torch.Tensor:
        """x [N, H] the block's (normed) tokens -> [N, H]; their K/V are written behind the context's."""
        hq, hkv = self.hq, self.hkv
        # [S, Q, Hq*D]
        q = ctx.to_padded(self.q_proj.forward(x))
        s, nq = q.shape[0], q.shape[1]
        # [S, Hq, Q, D]
        q = apply_rope(self.q_norm.forward(q.view(s, nq, hq, self.d).transpose(1, 2)), *rope)
        # [S, 2Hkv, T, D]: context then block
        write_kv(kv_cache, ctx, self._kv(x, rope, ctx))
        paged = (ctx.blocks, ctx.block_shift, ctx.kv_len)
        # [S, Q, Hq*D], or None where the fused kernel does not apply
        o = ops.attention(
            q, kv_cache[:, :hkv], kv_cache[:, hkv:], ctx.mask, self.scale, None, ctx.qlen, paged
        )
        if o is None:
            kv = read_kv(kv_cache, ctx, q.dtype)
            o = attention(q, kv[:, :hkv], kv[:, hkv:], ctx.mask, self.scale, None)
            o = o.transpose(1, 2).reshape(s, nq, hq * self.d)
        return self.o_proj.forward(ctx.to_packed(o))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope, ctx: AttnContext, kv_cache: torch.Tensor) -> torch.Tensor:
        a = self.self_attn.forward(self.input_layernorm.forward(h), rope, ctx, kv_cache)
        h, normed = self.post_attention_layernorm.add_forward(h, a)
        return h + self.mlp.forward(normed)


class DFlashDraft(nn.Module):
    packed_modules_mapping = PACKED_MODULES

    def __init__(
        self,
        cfg: ModelConfig,
        dflash: DFlashConfig,
        fc_in: int,
        draft_vocab: int,
        own_embed: bool = False,
        own_head: bool = False,
    ):
        super().__init__()
        self.cfg, self.dflash, h = cfg, dflash, cfg.hidden_size
        self.fc = Dense(fc_in, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        # the checkpoint's own embedding / LM head if it has them, else the target's (bind_target)
        self.embed_tokens: nn.Embedding | None = None
        if own_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, h, _weight=torch.empty(cfg.vocab_size, h))
        self.lm_head = Dense(h, draft_vocab, bias=False) if own_head else None
        # [draft_vocab] target id - draft id
        self.register_buffer("d2t", None)
        # [H] a separately trained embedding of the mask token (replaces its row of the embedding table)
        self.register_buffer("mask_embedding", None)
        self.mask_token: int | None = None
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling), persistent=False
        )

    def write_context(
        self,
        # [N, n H_target] the target's streams side by side
        states: torch.Tensor,
        # [S, Q]
        positions: torch.Tensor,
        ctx: AttnContext,
        # per draft layer
        kv: list[torch.Tensor],
    ) -> None:
        """The context K/V of every draft layer for these positions, into the draft's cache."""
        c = self.hidden_norm.forward(self.fc.forward(states))
        rope = rope_cos_sin(positions, self.inv_freq, c.dtype)
        for layer, cache in zip(self.layers, kv):
            layer.self_attn.write_context(c, rope, ctx, cache)

    def forward(
        self,
        # [N, H] embeddings of the block tokens
        embeds: torch.Tensor,
        # [S, Q]
        positions: torch.Tensor,
        ctx: AttnContext,
        kv: list[torch.Tensor],
    ) -> torch.Tensor:
        """-> the LM head's input [N, H] (normed) at every block position."""
        rope = rope_cos_sin(positions, self.inv_freq, embeds.dtype)
        h = embeds
        for layer, cache in zip(self.layers, kv):
            h = layer.forward(h, rope, ctx, cache)
        return self.norm.forward(h)

    def bind_target(self, target, mask_token: int) -> None:
        """The target's raw token embedding and LM head, unless the checkpoint has its own (bound methods: not
        submodules, so the target's weights are neither copied nor converted with the draft's); the mask token id."""
        self._target_embed = target.embed_tokens.forward
        self._target_head = target.lm_head.forward
        self.mask_token = mask_token

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[N] -> [N, H]; the mask token's row is the checkpoint's `mask_embedding` where it has one."""
        e = self._target_embed(ids) if self.embed_tokens is None else self.embed_tokens(ids)
        if self.mask_embedding is None:
            return e
        return torch.where((ids == self.mask_token)[:, None], self.mask_embedding.to(e.dtype), e)

    def draft_ids(self, head_in: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N] target token ids of the argmax."""
        logits = self._target_head(head_in) if self.lm_head is None else self.lm_head.forward(head_in)
        # the native row argmax where it applies (a full-vocabulary argmax per draft)
        ids = ops.argmax(logits)
        ids = logits.argmax(dim=-1) if ids is None else ids
        return ids if self.d2t is None else ids + self.d2t[ids]


def _layer_ids(value, key: str, where: str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        raise ValueError(f"{where}: {key} must be a non-empty list of layer indices, got {value!r}")
    return value


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: one target layer per draft layer, spread evenly over 1 .. L - 3 (the middle one for a
    single draft layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def dflash_config(hf: dict, num_target_layers: int, where: str = "config.json") -> DFlashConfig:
    """The DFlash settings of a draft's config.json, checked against a target of `num_target_layers` layers.

    Target layers: vLLM's `eagle_aux_hidden_state_layer_ids` (aux ids) if given, else `dflash_config.
    target_layer_ids` (layer outputs: aux id j + 1), else z-lab's default spread for `num_target_layers` (the
    config's, else the target's)."""
    dflash = hf.get("dflash_config", {})
    if not isinstance(dflash, dict):
        raise ValueError(f"{where}: dflash_config must be an object, got {type(dflash).__name__}")
    for key, bad in (
        ("use_aux_hidden_state", dflash.get("use_aux_hidden_state", True) is not True),
        ("use_swa", bool(dflash.get("use_swa"))),
        ("attention_sink_bias", bool(dflash.get("attention_sink_bias"))),
        ("layer_types", "sliding_attention" in (hf.get("layer_types") or ())),
    ):
        if bad:
            raise ValueError(
                f"{where}: {key}={dflash.get(key, hf.get(key))!r}: this build runs DFlash drafts with full attention "
                "layers that read the target's aux hidden states; remove the key or use another draft"
            )
    block = config_int(
        dflash.get("block_size", hf.get("block_size", DEFAULT_BLOCK_SIZE)), "block_size", where, 2
    )
    n = num_target_layers
    if hf.get("eagle_aux_hidden_state_layer_ids") is not None:
        key = "eagle_aux_hidden_state_layer_ids"
        aux = _layer_ids(hf[key], key, where)
        ids, lo, hi = aux, 0, n
    else:
        key = "dflash_config.target_layer_ids"
        ids = dflash.get("target_layer_ids", hf.get("target_layer_ids"))
        if ids is None:
            layers = config_int(hf.get("num_target_layers", n), "num_target_layers", where)
            ids = build_target_layer_ids(
                layers, config_int(hf.get("num_hidden_layers"), "num_hidden_layers", where)
            )
        ids, lo, hi = _layer_ids(ids, key, where), 0, n - 1
        aux = [i + 1 for i in ids]
    if any(not lo <= i <= hi for i in ids) or any(a >= b for a, b in zip(ids, ids[1:])):
        raise ValueError(
            f"{where}: {key} {ids} must be increasing ids in {lo}..{hi}: the target has {n} layers (the streams are "
            "concatenated in layer order)"
        )
    # vLLM's precedence: the top-level is_causal, then dflash_config.causal; non-causal by default
    causal = hf.get("is_causal")
    causal = dflash.get("causal") if causal is None else causal
    return DFlashConfig(block, tuple(aux), bool(causal))
