"""Megatron-style shards: every rank's slices put back together are the whole weight, quantized columns are cut at
block boundaries, and the sum of the ranks' partial products is the whole layer's output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import model_config
from verispec.config import ModelConfig
from verispec.distributed.shard import Shard, check_divisible, slice_tensor, split_sizes
from verispec.kernels.qweight import QuantWeight


def _cfg(heads=8, kv=2, inter=256, vocab=1000, hidden=64) -> ModelConfig:
    return model_config(heads, kv, hidden, inter, vocab)


def test_split_sizes_are_aligned_and_add_up():
    assert split_sizes(8960, 2) == [4480, 4480]
    assert split_sizes(8960, 3) == [3008, 2976, 2976]
    assert split_sizes(1000, 2) == [512, 488]
    for total, parts in [(151936, 2), (151936, 4), (49152, 8), (33, 2)]:
        sizes = split_sizes(total, parts)
        assert sum(sizes) == total and all(s % 32 == 0 for s in sizes[:-1])


@pytest.mark.parametrize(
    "cfg, size, key",
    [
        (_cfg(heads=9, kv=3), 2, "num_attention_heads=9"),
        (_cfg(heads=12, kv=3), 2, "num_key_value_heads=3"),
        (_cfg(heads=8, kv=2, inter=32), 2, "intermediate_size=32"),
    ],
)
def test_sizes_that_do_not_divide_are_refused_naming_the_setting(cfg, size, key):
    with pytest.raises(ValueError, match="tensor_parallel_size=2") as e:
        check_divisible(cfg, size)
    assert key in str(e.value)


def test_more_ranks_than_kv_heads_replicate_them():
    cfg = _cfg(heads=8, kv=2)
    check_divisible(cfg, 4)
    got = [(Shard(cfg, r, 4).q_heads, Shard(cfg, r, 4).kv_heads) for r in range(4)]
    # q heads 0-3 read KV head 0, 4-7 KV head 1 (GQA groups of 4)
    assert got == [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]
    assert Shard(cfg, 3, 4).local_config().num_kv_heads == 1


def _checkpoint(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {
        "layers.0.self_attn.q_proj.weight": (cfg.num_heads * d, h),
        "layers.0.self_attn.q_proj.bias": (cfg.num_heads * d,),
        "layers.0.self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
        "layers.0.self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
        "layers.0.self_attn.o_proj.weight": (h, cfg.num_heads * d),
        "layers.0.mlp.gate_proj.weight": (i, h),
        "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i),
        "layers.0.input_layernorm.weight": (h,),
        "embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_the_ranks_slices_make_up_every_weight():
    cfg = _cfg()
    full = _checkpoint(cfg)
    parts = [Shard(cfg, r, 2).shard_tensors(full) for r in range(2)]
    rows = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
    for key, value in full.items():
        got = [p[key] for p in parts]
        if any(name in key for name in rows):
            assert torch.equal(torch.cat(got, 0), value), key
        elif "o_proj" in key or "down_proj" in key:
            assert torch.equal(torch.cat(got, 1), value), key
        else:
            assert all(g is value for g in got), key


def test_the_sum_of_partial_mlp_products_is_the_whole_mlp():
    cfg = _cfg()
    full = _checkpoint(cfg)
    x = torch.randn(3, cfg.hidden_size, dtype=torch.float64)

    def mlp(w):
        gate, up, down = (w[f"layers.0.mlp.{n}_proj.weight"].double() for n in ("gate", "up", "down"))
        return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T

    total = sum(mlp(Shard(cfg, r, 2).shard_tensors(full)) for r in range(2))
    torch.testing.assert_close(total, mlp(full))


def test_quantized_columns_are_cut_at_whole_blocks():
    w = torch.randn(48, 256)
    q = QuantWeight.quantize_q8(w)
    cut = slice_tensor(q, 1, 64, 160)
    assert cut.shape == (48, 96)
    assert torch.equal(cut.dequantize(), q.dequantize()[:, 64:160])
    rows = slice_tensor(q, 0, 16, 48)
    assert torch.equal(rows.dequantize(), q.dequantize()[16:48])
    with pytest.raises(ValueError, match="blocks of 32"):
        slice_tensor(q, 1, 16, 160)
    assert isinstance(cut.blocks, np.ndarray) and cut.blocks.flags.c_contiguous
