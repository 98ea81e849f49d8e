"""One decoder-only transformer covering Llama / Mistral / SmolLM / Qwen2 / Qwen3 / Gemma 3 (text).

Differences are flags on ModelConfig, not subclasses: qkv bias (Qwen2), q/k norm (Qwen3, Gemma 3),
Gemma 3's sandwich norms, embedding scale, sliding-window layers with their own RoPE base, GELU MLP
and soft-capping. Fused qkv and gate_up projections keep the op count (and Python overhead) low.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.config import ModelConfig
from verispec.distributed.group import TPGroup
from verispec.kernels import cuda_ops, ops
from verispec.kernels.fused_layers import FusedLayers, why_not_fusable
from verispec.layers.attention import AttnContext, attention, read_kv, write_kv
from verispec.layers.embedding import Embedding
from verispec.layers.linear import Dense
from verispec.layers.norm import RMSNorm
from verispec.layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq
from verispec.layers.weight_loader import default_weight_loader

# Submodules are called through .forward(): nn.Module.__call__ costs a few microseconds of hook bookkeeping per
# call, ~300 times per decode step, and nothing here uses hooks.

# Checkpoint module -> (fused module, shard): how HF checkpoints' separate projections load into the fused ones of
# these blocks (loader/weights.py). Every model built from these blocks declares it (EAGLE, EAGLE-3, MTP too).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding: bool):
        super().__init__()
        self.cfg, self.sliding = cfg, sliding
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = self.hq * self.d, self.hkv * self.d
        shards = {"q": q, "k": kv, "v": kv}
        self.qkv_proj = Dense(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias, shards=shards)
        self.o_proj = Dense(self.hq * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        pre = cfg.query_pre_attn_scalar
        self.scale = (pre if pre else self.d) ** -0.5

    def forward(self, x, rope, ctx: AttnContext, kv_cache) -> torch.Tensor:
        """x [N, hidden] packed tokens -> [N, hidden]; attention itself runs on the padded [S, Q] layout."""
        hq, hkv = self.hq, self.hkv
        # [S, Q, (Hq+2Hkv)*D]
        qkv = ctx.to_padded(self.qkv_proj.forward(x))
        s, nq = qkv.shape[0], qkv.shape[1]
        # [S, Hq+2Hkv, Q, D]
        qkv = qkv.view(s, nq, hq + 2 * hkv, self.d).transpose(1, 2)
        qk = qkv[:, : hq + hkv]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm.forward(qk[:, :hq]), self.k_norm.forward(qk[:, hq:])), dim=1)
        if self.q_norm is not None or not ops.rope_(qk, *rope, ctx.qlen):
            # RoPE on q and k together, in place
            qkv[:, : hq + hkv] = apply_rope(qk, *rope)
        # one cache write for K and V
        write_kv(kv_cache, ctx, qkv[:, hq:])
        mask = ctx.sliding_mask if self.sliding else ctx.mask
        q, cap = qkv[:, :hq], self.cfg.attn_logit_softcapping
        # [S, Q, Hq*D], or None where the fused kernel does not apply; it reads the blocks in place
        paged = (ctx.blocks, ctx.block_shift, ctx.kv_len)
        o = ops.attention(q, kv_cache[:, :hkv], kv_cache[:, hkv:], mask, self.scale, cap, ctx.qlen, paged)
        if o is None and cuda_ops.applies(x):
            # the batch-invariant Triton kernel, which reads the blocks in place too
            k, v = kv_cache[:, :hkv], kv_cache[:, hkv:]
            visible, paged = ctx.visible(self.sliding), (ctx.blocks, ctx.block_shift)
            o = cuda_ops.attention(q, k, v, self.scale, cap, visible, paged)
        if o is None:
            # [S, 2Hkv, T, D]
            kv = read_kv(kv_cache, ctx, q.dtype)
            k, v = kv[:, :hkv], kv[:, hkv:]
            o = attention(q, k, v, mask, self.scale, cap).transpose(1, 2).reshape(s, nq, hq * self.d)
        return self.o_proj.forward(ctx.to_packed(o))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        inter = cfg.intermediate_size
        self.gate_up_proj = Dense(cfg.hidden_size, 2 * inter, bias=False, shards={0: inter, 1: inter})
        self.down_proj = Dense(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act.startswith("gelu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        act = None if self.gelu else ops.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.split(self.inter, dim=-1)
            act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        return self.down_proj.forward(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, tp: TPGroup | None = None):
        super().__init__()
        # tensor parallelism: attention's and the MLP's partial sums are all-reduced over the ranks
        self.tp = tp
        self.sliding = cfg.layer_is_sliding(idx)
        self.self_attn = Attention(cfg, self.sliding)
        self.mlp = MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.sandwich = cfg.is_gemma
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, h, ropes, ctx, kv_cache) -> torch.Tensor:
        rope = ropes[1] if self.sliding else ropes[0]
        a = self._reduce(self.self_attn.forward(self.input_layernorm.forward(h), rope, ctx, kv_cache))
        if self.sandwich:
            h = h + self.post_attention_layernorm.forward(a)
            return h + self.post_feedforward_layernorm.forward(
                self._reduce(self.mlp.forward(self.pre_feedforward_layernorm.forward(h)))
            )
        h, normed = self.post_attention_layernorm.add_forward(h, a)
        return h + self._reduce(self.mlp.forward(normed))

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else self.tp.all_reduce(x.contiguous())


def gemma_norm_loader(param: nn.Parameter, value: torch.Tensor) -> None:
    """Gemma's norms multiply by (1 + w): the 1 is folded into the weight as it loads."""
    default_weight_loader(param, value.float() + 1.0)


class DecoderLM(nn.Module):
    """forward(input_ids [N] packed, positions [S, Q], ctx, kv) -> final normed hidden [N, hidden].

    Under tensor parallelism `cfg` holds this rank's heads and MLP columns (distributed/shard.py), `tp` its
    group and `vocab_sizes` every rank's rows of the LM head: compute_logits gathers them on rank 0."""

    packed_modules_mapping = PACKED_MODULES

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None, vocab_sizes: list[int] | None = None):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.vocab_sizes = vocab_sizes or [cfg.vocab_size]
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        rows = self.vocab_sizes[tp.rank] if tp is not None else cfg.vocab_size
        self.lm_head = Dense(cfg.hidden_size, rows, bias=False)
        # FusedLayers once the weights are loaded, if the model qualifies (fuse_layers)
        self.fused = None
        self.embed_scale = cfg.hidden_size**0.5 if cfg.is_gemma else 1.0
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling), persistent=False
        )
        local = cfg.rope_local_theta or cfg.rope_theta
        self.register_buffer("inv_freq_local", rope_inv_freq(cfg.head_dim, local), persistent=False)
        if cfg.is_gemma:
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight_loader = gemma_norm_loader

    def fuse_layers(self) -> str | None:
        """Run the layers through one C call where possible (kernels/fused_layers.py); returns why not, or None."""

        reason = why_not_fusable(self)
        self.fused = FusedLayers(self) if reason is None else None
        return reason

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h * self.embed_scale if self.embed_scale != 1.0 else h

    def forward(
        self,
        # [N] packed new tokens of all rows
        input_ids: torch.Tensor,
        # [S, Q] RoPE positions
        positions: torch.Tensor,
        ctx: AttnContext,
        # per layer [slots, 2*Hkv, T, D]
        kv: list[torch.Tensor],
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (final normed hidden [N, hidden], the residual streams entering the aux layers side by side
        [N, len(aux_layers) * hidden] in increasing layer order, or None without aux layers: EAGLE-3's input as it
        is).

        Aux layer i is the residual stream entering layer i (vLLM's convention); i = num_layers is the stream after
        the last layer, before the final norm."""
        h = self.embed(input_ids)
        rope = rope_cos_sin(positions, self.inv_freq, h.dtype)
        ropes = (
            rope,
            rope_cos_sin(positions, self.inv_freq_local, h.dtype) if self.cfg.layer_types else rope,
        )
        aux: list[torch.Tensor] = []
        if self.fused is not None and self.fused.applies(h, rope, ctx):
            return self._forward_fused(h, rope, ctx, kv, aux_layers)
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(h)
            h = layer.forward(h, ropes, ctx, kv[i])
        if len(self.layers) in aux_layers:
            aux.append(h)
        return self.norm.forward(h), torch.cat(aux, dim=-1) if aux else None

    def _forward_fused(self, h, rope, ctx, kv, aux_layers) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward's layers by FusedLayers on the packed tokens h [N, hidden] (updated in place)."""
        # the final norm [N, hidden] and the aux layers' streams side by side, by the layers' one call
        return self.fused.run(h.contiguous(), rope, ctx, kv, torch.empty_like(h), tuple(aux_layers))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [..., hidden] -> logits [..., V] (float32); under tensor parallelism a collective: every rank
        calls it, rank 0 gets the logits, the others None."""
        logits = self.lm_head.forward(hidden).float()
        if self.tp is not None:
            shape = logits.shape
            # [N, V] on rank 0 from every rank's [N, V_rank]
            logits = self.tp.gather_columns(logits.reshape(-1, shape[-1]), self.vocab_sizes)
            if logits is None:
                return None
            logits = logits.view(*shape[:-1], logits.shape[-1])
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


class WholeHead:
    """A tensor-parallel rank's own LM head over the whole vocabulary, for the drafters that share the target's
    embedding and head (EAGLE, MTP, DFlash): the target's embedding (whole on every rank) and logits computed on
    this rank alone, with no collective, from the head's weight read again from the checkpoint."""

    def __init__(self, target: DecoderLM, weight):
        cfg = target.cfg
        self.cfg, self.embed, self.embed_tokens = cfg, target.embed, target.embed_tokens
        self.lm_head = Dense(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight_loader(self.lm_head.weight, weight)
        self.lm_head.finish_loading()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] (float32)."""
        logits = self.lm_head.forward(hidden).float()
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits
