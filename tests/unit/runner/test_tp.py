"""Rank 0's messages: a step's rows survive the trip, and a worker's cache mirrors rank 0's K/V through moves and
copies (in one process: a recording group stands in for the ranks)."""

from __future__ import annotations

import torch

from tests.helpers import model_config
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import RowInput
from verispec.runner.tp import MirroredKVCache, apply_message, decode_run, encode_run


class Recorder:
    """A group whose broadcasts are kept (rank 0's side)."""

    def __init__(self):
        self.sent: list[list[int]] = []

    def broadcast(self, message):
        self.sent.append(message.tolist())
        return message


class Runner:
    """A worker's runner: the cache, and the rows each RUN hands it."""

    def __init__(self, cache):
        self.cache, self.runs = cache, []

    def run(self, rows, aux, aux_all, hidden_all):
        self.runs.append((rows, aux, aux_all, hidden_all))


def _pair() -> tuple[MirroredKVCache, KVCache, Recorder]:
    cfg = model_config()
    rank0 = MirroredKVCache(cfg, 3, 64, torch.device("cpu"), torch.float32, num_blocks=20, block_size=8)
    rank0.group = Recorder()
    worker = KVCache(cfg, 3, 64, torch.device("cpu"), torch.float32, num_blocks=20, block_size=8)
    return rank0, worker, rank0.group


def test_rows_survive_the_message():
    rank0, worker, _ = _pair()
    rank0.grow(1, 20)
    rank0.grow(2, 9)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    rows = [
        RowInput(2, 8, [4, 5], logits_from=1),
        RowInput(1, 17, [7, 8, 9], tree_mask=tree, depths=[0, 1, 1]),
    ]
    msg = encode_run(rank0, rows, (0, 2), True, False).tolist()
    got, aux, aux_all, hidden_all = decode_run(worker, msg)
    assert (aux, aux_all, hidden_all) == ((0, 2), True, False)
    for a, b in zip(got, rows):
        assert (a.slot, a.start, a.token_ids, a.logits_from, a.depths) == (
            b.slot,
            b.start,
            b.token_ids,
            b.logits_from,
            b.depths,
        )
        assert (a.tree_mask is None) == (b.tree_mask is None)
    assert torch.equal(got[1].tree_mask, tree)
    # the worker's table rows of the step's slots are rank 0's
    assert torch.equal(worker.block_table[1:3], rank0.block_table[1:3])


def test_moves_and_copies_leave_the_worker_cache_equal():
    rank0, worker, group = _pair()
    runner = Runner(worker)
    rank0.grow(0, 30)
    apply_message(runner, encode_run(rank0, [RowInput(0, 0, [1])], (), False, False).tolist())
    for kv0, kv1 in zip(rank0.kv, worker.kv):
        values = torch.randn_like(kv0)
        kv0.copy_(values)
        kv1.copy_(values)
    rank0.move(0, [20, 22, 25], [17, 18, 19])
    rank0.copy_prefix(0, [1, 2], 24)
    for msg in group.sent:
        assert apply_message(runner, msg)
    for slot in range(3):
        for kv0, kv1 in zip(rank0.kv, worker.kv):
            blocks0 = rank0.block_table[slot, : len(rank0.blocks[slot])]
            blocks1 = worker.block_table[slot, : len(rank0.blocks[slot])]
            assert torch.equal(kv0[blocks0], kv1[blocks1])
    assert not apply_message(runner, [4])
