"""Megatron-style shards of a decoder's weights for one tensor-parallel rank (pure functions, no processes).

Column-parallel (each rank keeps some output rows): q / k / v by attention heads, gate / up by MLP columns, the LM
head by vocabulary rows. Row-parallel (each rank keeps some input columns, the partial products are summed by an
all-reduce): o_proj by the heads it reads, down_proj by the MLP columns it reads. Norms and the embedding stay
whole on every rank. Quantized weights (repacked GGUF blocks of 32 along the input) are cut at block boundaries,
so the MLP's columns go to ranks in multiples of 32 and no weight is ever re-quantized.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from verispec.config import ModelConfig
from verispec.kernels.qweight import BLOCK_BYTES, QK, QuantWeight

# the MLP's columns and the vocabulary go to ranks in multiples of this: whole quantized blocks along the input of
# down_proj, and row counts the tiled / int8 layouts take (multiples of 16)
ALIGN = QK


def split_sizes(total: int, parts: int, align: int = ALIGN) -> list[int]:
    """`total` in `parts` shares as even as multiples of `align` allow (the remainder to the last share)."""
    units, rest = divmod(total, align)
    base, extra = divmod(units, parts)
    sizes = [(base + (i < extra)) * align for i in range(parts)]
    sizes[-1] += rest
    return sizes


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """ValueError naming tensor_parallel_size if `cfg`'s heads cannot be spread over `size` ranks."""
    if size == 1:
        return
    if cfg.num_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} must divide the model's num_attention_heads={cfg.num_heads}"
        )
    hkv = cfg.num_kv_heads
    if hkv % size and size % hkv:
        raise ValueError(
            f"tensor_parallel_size={size} must divide the model's num_key_value_heads={hkv}, or be a multiple "
            "of it (KV heads are then replicated)"
        )
    if cfg.intermediate_size < size * ALIGN:
        raise ValueError(
            f"tensor_parallel_size={size} is too large for intermediate_size={cfg.intermediate_size} "
            f"(each rank takes a multiple of {ALIGN} columns)"
        )


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds of a model whose full configuration is `cfg`."""

    cfg: ModelConfig
    rank: int
    size: int

    @property
    def q_heads(self) -> tuple[int, int]:
        n = self.cfg.num_heads // self.size
        return self.rank * n, (self.rank + 1) * n

    @property
    def kv_heads(self) -> tuple[int, int]:
        """This rank's KV heads; with more ranks than KV heads, the one its q heads read (replicated)."""
        hkv, size = self.cfg.num_kv_heads, self.size
        if hkv % size == 0:
            n = hkv // size
            return self.rank * n, (self.rank + 1) * n
        head = self.rank // (size // hkv)
        return head, head + 1

    @property
    def mlp_columns(self) -> tuple[int, int]:
        sizes = split_sizes(self.cfg.intermediate_size, self.size)
        return sum(sizes[: self.rank]), sum(sizes[: self.rank + 1])

    @property
    def vocab_sizes(self) -> list[int]:
        """Every rank's share of the LM head's rows, in rank order."""
        return split_sizes(self.cfg.vocab_size, self.size)

    @property
    def vocab_rows(self) -> tuple[int, int]:
        sizes = self.vocab_sizes
        return sum(sizes[: self.rank]), sum(sizes[: self.rank + 1])

    def local_config(self) -> ModelConfig:
        """The configuration of this rank's layers (its heads and MLP columns; vocabulary and hidden size whole)."""
        (q0, q1), (k0, k1), (m0, m1) = self.q_heads, self.kv_heads, self.mlp_columns
        return replace(self.cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=m1 - m0)

    def _rules(self) -> dict[str, tuple[int, tuple[int, int]]]:
        """checkpoint module name -> (dim cut: 0 rows, 1 columns; the kept range along it)."""
        d = self.cfg.head_dim
        (q0, q1), (k0, k1) = self.q_heads, self.kv_heads
        q, kv, mlp = (q0 * d, q1 * d), (k0 * d, k1 * d), self.mlp_columns
        return {
            "self_attn.q_proj": (0, q),
            "self_attn.k_proj": (0, kv),
            "self_attn.v_proj": (0, kv),
            "self_attn.o_proj": (1, q),
            "mlp.gate_proj": (0, mlp),
            "mlp.up_proj": (0, mlp),
            "mlp.down_proj": (1, mlp),
            "lm_head": (0, self.vocab_rows),
        }

    def shard_tensors(self, tensors: Mapping[str, object]) -> dict[str, object]:
        """A decoder's checkpoint tensors (HF names without the `model.` prefix) -> this rank's: each cut
        weight and bias sliced, everything else as it is."""
        rules = self._rules()
        out = {}
        for key, value in tensors.items():
            module, _, leaf = key.rpartition(".")
            rule = next(
                (r for name, r in rules.items() if module == name or module.endswith("." + name)), None
            )
            if rule is None or (rule[0] == 1 and leaf != "weight"):
                # a row-parallel layer's bias (none in these models) would be added once, after the sum
                out[key] = value
                continue
            dim, (lo, hi) = rule
            out[key] = slice_tensor(value, dim, lo, hi)
        return out


def slice_tensor(value, dim: int, lo: int, hi: int):
    """Rows (dim 0) or columns (dim 1) [lo, hi) of a float tensor or of a QuantWeight (columns at whole blocks)."""
    if not isinstance(value, QuantWeight):
        if dim == 1 and value.dim() == 1:
            return value
        return value.narrow(dim, lo, hi - lo).contiguous() if isinstance(value, torch.Tensor) else value
    n, k = value.shape
    if dim == 0:
        return QuantWeight(value.fmt, value.blocks[lo:hi], (hi - lo, k))
    if lo % QK or hi % QK:
        raise ValueError(f"cannot cut a quantized weight's columns at {lo}:{hi} (blocks of {QK})")
    per = BLOCK_BYTES[value.fmt]
    blocks = np.ascontiguousarray(value.blocks[:, lo // QK * per : hi // QK * per])
    return QuantWeight(value.fmt, blocks, (n, hi - lo))
