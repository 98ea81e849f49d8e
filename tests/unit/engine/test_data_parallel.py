"""The data-parallel front end's pure parts: routing by cached prefix then load, the replicas' counters as one, and
where the replicas run."""

from __future__ import annotations

import pytest
import torch

from verispec.engine.args import EngineArgs
from verispec.engine.data_parallel import PrefixRouter, replica_devices, start_replicas, sum_counters
from verispec.metrics import EngineCounters, SpecDecodingStats


def test_a_prompt_goes_back_to_the_replica_that_holds_its_prefix():
    router = PrefixRouter(2, block_size=4)
    history = list(range(100, 112))
    first = router.route(history, [0, 0], [True, True])
    # another conversation goes to the other (less used) replica
    other = router.route(list(range(500, 512)), [1, 0], [True, True])
    assert other != first
    # the next turn: the history and more, while both replicas are about as busy
    assert router.route(history + [7, 8, 9, 10, 11], [1, 1], [True, True]) == first


def test_load_wins_over_the_prefix_beyond_the_slack_and_dead_replicas_are_skipped():
    router = PrefixRouter(3, block_size=4, slack=2)
    ids = list(range(40))
    owner = router.route(ids, [0, 0, 0], [True] * 3)
    busy = [0, 0, 0]
    busy[owner] = 3
    assert router.route(ids, busy, [True] * 3) != owner
    alive = [True] * 3
    alive[owner] = False
    assert router.route(ids, [0, 0, 0], alive) != owner


def test_ties_spread_requests_and_the_memory_is_bounded():
    router = PrefixRouter(2, block_size=2, capacity=8)
    picks = [router.route([i, i, i, i], [0, 0], [True, True]) for i in range(10)]
    assert picks.count(0) == picks.count(1) == 5
    assert len(router._owner) == 8


def test_counters_add_up():
    a = EngineCounters(prompt_tokens=3, generation_tokens=10, prefix_cache_hits=4, kv_cache_usage=0.2)
    b = EngineCounters(prompt_tokens=5, generation_tokens=1, prefix_cache_hits=1, kv_cache_usage=0.4)
    a.spec = SpecDecodingStats(2, num_drafts=1, num_draft_tokens=2, num_accepted_tokens=1)
    b.spec = SpecDecodingStats(2, num_drafts=2, num_draft_tokens=4, num_accepted_tokens=3)
    total = sum_counters([a, b])
    assert (total.prompt_tokens, total.generation_tokens, total.prefix_cache_hits) == (8, 11, 5)
    assert abs(total.kv_cache_usage - 0.3) < 1e-9
    assert (total.spec.num_drafts, total.spec.num_draft_tokens, total.spec.num_accepted_tokens) == (3, 6, 4)
    assert sum_counters([EngineCounters(), EngineCounters()]).spec is None


def test_replicas_take_the_gpus_in_turn():
    assert replica_devices("cpu", 2, 4) == ["cpu", "cpu"]
    assert replica_devices("auto", 2, 0) == ["cpu", "cpu"]
    assert replica_devices("auto", 3, 2) == ["cuda:0", "cuda:1", "cuda:0"]
    assert replica_devices("cuda", 2, 8) == ["cuda:0", "cuda:1"]
    assert replica_devices("cuda:1", 2, 2) == ["cuda:1", "cuda:1"]
    with pytest.raises(ValueError, match="device='cuda' was requested but CUDA is not available"):
        replica_devices("cuda", 2, 0)


def test_replicas_sharing_a_gpu_need_a_kv_budget(monkeypatch):
    """Refused before any process starts: each replica's default budget would count the others' memory as free."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = EngineArgs(model="unused", device="auto", data_parallel_size=2)
    with pytest.raises(
        ValueError, match="data_parallel_size=2 puts more than one replica on cuda:0.*kv_cache_memory"
    ):
        start_replicas(args)
