"""verispec/runner/kv_cache.py: the block pool's size from a memory budget (plan_cache), slots growing by blocks,
copies and moves through the block table."""

from __future__ import annotations

import pytest
import torch

from verispec.config import ModelConfig
from verispec.runner.block_pool import NULL_BLOCK
from verispec.runner.kv_cache import KVCache, plan_cache


@pytest.fixture
def cfg() -> ModelConfig:
    # 2 layers x 2 KV heads x 16 dims: K and V take 512 bytes a token in float32
    return ModelConfig("LlamaForCausalLM", "llama", 100, 32, 64, 2, 4, 2, 16, 1e-6, 1e4, 4096, False)


def _paged(cfg: ModelConfig, blocks: int = 9, slots: int = 4, t_alloc: int = 64) -> KVCache:
    return KVCache(cfg, slots, t_alloc, torch.device("cpu"), torch.float32, num_blocks=blocks, block_size=8)


def test_the_budget_decides_the_blocks_and_every_sequence_gets_a_slot(cfg):
    # 255 tokens + the scratch position: 16 blocks of 16 a sequence
    per_seq = 512 * 256
    plan = plan_cache(cfg, 8, 255, 3 * per_seq)
    assert (plan.num_slots, plan.num_blocks) == (8, 3 * 16 + 1)
    # never more blocks than max_num_seqs full sequences take
    assert plan_cache(cfg, 2, 255, 3 * per_seq).num_blocks == 2 * 16 + 1


def test_two_byte_kv_holds_twice_the_blocks(cfg):
    # bfloat16 K and V (the CUDA path) take half the bytes of float32
    assert plan_cache(cfg, 8, 255, 3 * 512 * 256, dtype_bytes=2).num_blocks == 6 * 16 + 1


def test_a_budget_below_one_sequence_is_an_error(cfg):
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=255"):
        plan_cache(cfg, 1, 255, 512 * 100)


def test_an_unsupported_block_size_is_an_error(cfg):
    with pytest.raises(
        ValueError, match=r"block_size=12 is not supported; choose one of \[8, 16, 32, 64, 128\]"
    ):
        KVCache(cfg, 1, 64, torch.device("cpu"), torch.float32, num_blocks=4, block_size=12)


def test_a_slot_grows_block_by_block_and_gives_them_back(cfg):
    cache = _paged(cfg)
    slot = cache.allocate()
    assert cache.grow(slot, 1) and len(cache.blocks[slot]) == 1
    assert cache.grow(slot, 8) and len(cache.blocks[slot]) == 1
    assert cache.grow(slot, 17) and len(cache.blocks[slot]) == 3
    assert cache.block_table[slot, :3].tolist() == cache.blocks[slot]
    assert cache.block_table[slot, 3:].eq(NULL_BLOCK).all()
    # 8 usable blocks: 5 more do not fit, and nothing is taken
    other = cache.allocate()
    assert not cache.grow(other, 6 * 8) and cache.blocks[other] == []
    assert cache.usage == 3 / 8
    cache.free(slot)
    assert cache.usage == 0 and cache.block_table[slot].eq(NULL_BLOCK).all()


def test_drafter_caches_hold_every_block_of_every_slot(cfg):
    cache = KVCache(cfg, 2, 20, torch.device("cpu"), torch.float32, block_size=8)
    assert [len(b) for b in cache.blocks] == [3, 3] and cache.pool.num_free == 0
    slot = cache.allocate()
    cache.free(slot)
    # freeing the slot keeps its blocks: it is addressed directly
    assert len(cache.blocks[slot]) == 3


def test_copy_prefix_copies_a_slots_first_blocks_into_others(cfg):
    cache = _paged(cfg, blocks=12)
    src = cache.allocate()
    cache.grow(src, 10)
    for kv in cache.kv:
        kv[cache.blocks[src]] = torch.randn(2, *kv.shape[1:])
    dst = [cache.allocate(), cache.allocate()]
    cache.copy_prefix(src, dst, 10)
    for kv in cache.kv:
        for d in dst:
            assert torch.equal(kv[cache.blocks[d]], kv[cache.blocks[src]])
        # nothing else written
        others = sorted(set(range(12)) - {b for s in (src, *dst) for b in cache.blocks[s]})
        assert not kv[others].any()


def test_move_copies_positions_through_the_block_table(cfg):
    cache = _paged(cfg)
    slot = cache.allocate()
    cache.grow(slot, 24)
    kv = cache.kv[0]
    for kv in cache.kv:
        kv.normal_()
    before = [k.clone() for k in cache.kv]
    # position 17 (block 2, row 1) to position 9 (block 1, row 1)
    cache.move(slot, [17], [9])
    b = cache.blocks[slot]
    for kv, old in zip(cache.kv, before):
        assert torch.equal(kv[b[1], :, 1], old[b[2], :, 1])
        assert torch.equal(kv[b[0]], old[b[0]])


def test_a_draft_models_full_length_cache_bounds_the_slots(cfg):
    # a draft model keeps each of its slots at full length: no more slots than full sequences fit
    plan = plan_cache(cfg, 8, 255, 3 * 512 * 256, full_length_slots=True)
    assert (plan.num_slots, plan.num_blocks) == (3, 3 * 16 + 1)
