"""verispec/runner/kv_cache.py: slots and context length from a memory budget (plan_cache), slot copies."""

from __future__ import annotations

import pytest
import torch

from verispec.config import ModelConfig
from verispec.runner.kv_cache import KVCache, plan_cache


@pytest.fixture
def cfg() -> ModelConfig:
    # 2 layers x 2 KV heads x 16 dims: K and V take 512 bytes a token in float32
    return ModelConfig("LlamaForCausalLM", "llama", 100, 32, 64, 2, 4, 2, 16, 1e-6, 1e4, 4096, False)


def test_the_budget_decides_the_slots(cfg):
    per_seq = 512 * (255 + 1)
    assert plan_cache(cfg, 8, 255, 3 * per_seq).num_slots == 3
    assert plan_cache(cfg, 2, 255, 3 * per_seq).num_slots == 2


def test_two_byte_kv_holds_twice_the_sequences(cfg):
    # bfloat16 K and V (the CUDA path) take half the bytes of float32
    per_seq = 512 * (255 + 1)
    assert plan_cache(cfg, 8, 255, 3 * per_seq, dtype_bytes=2).num_slots == 6


def test_a_budget_below_one_sequence_is_an_error(cfg):
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=255"):
        plan_cache(cfg, 1, 255, 512 * 100)


def test_copy_prefix_copies_a_slots_first_positions_into_others(cfg):
    cache = KVCache(cfg, 4, 8, torch.device("cpu"), torch.float32)
    for kv in cache.kv:
        kv[0] = torch.randn(kv[0].shape)
    cache.copy_prefix(0, [2, 3], 5)
    for kv in cache.kv:
        assert torch.equal(kv[2, :, :5], kv[0, :, :5]) and torch.equal(kv[3, :, :5], kv[0, :, :5])
        # the rest untouched
        assert not kv[2, :, 5:].any() and not kv[1].any()
