"""The state pool keeps each position's state where its K/V is: read back through the block table, shared by a
slot that adopts the same blocks (a prefix-cache hit)."""

from __future__ import annotations

import torch

from tests.helpers import model_config
from verispec.runner.kv_cache import KVCache
from verispec.runner.state_pool import StatePool


def test_states_follow_the_blocks():
    cache = KVCache(model_config(), 3, 64, torch.device("cpu"), torch.float32, num_blocks=12, block_size=8)
    pool = StatePool(cache)
    assert pool.read(0, 4) is None
    cache.grow(0, 20)
    states = torch.randn(20, 6)
    pool.write(0, 0, states[:13])
    pool.write(0, 13, states[13:])
    assert torch.equal(pool.read(0, 20), states)
    # another slot adopting slot 0's first two blocks reads their 16 states
    cache.adopt(1, cache.blocks[0][:2])
    assert torch.equal(pool.read(1, 16), states[:16])
