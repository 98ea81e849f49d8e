"""Tensor parallelism on the engine's side: rank 0 runs the scheduler, proposer, planner and sampler; every forward
and every operation on the KV cache's contents is first sent to the other ranks as one int64 message, then run
by all of them together (the layers' all-reduces and the LM head's gather keep them in step).

A message is [op, ...]. RUN: the step's rows (slot, start, tokens, logits_from, RoPE depths, tree mask) and the
block-table rows of the slots it reads, so a worker's table mirrors rank 0's where it matters. MOVE and COPY: the
cache operations of token trees and of the step-cost profile. STOP ends the workers.
"""

from __future__ import annotations

import atexit

import torch

from verispec.distributed.group import TPGroup
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner, RowInput, RunnerOutput

RUN, MOVE, COPY, STOP, PLAN = 1, 2, 3, 4, 5


def _table_rows(cache: KVCache, slots: list[int]) -> list[int]:
    """[n, slots..., width, rows flattened]: the block-table rows of `slots`, as far as any of them holds blocks."""
    width = max([len(cache.blocks[s]) for s in slots] + [1])
    rows = cache.block_table[slots, :width]
    return [len(slots), *slots, width, *rows.flatten().tolist()]


def _apply_table_rows(cache: KVCache, msg: list[int], at: int) -> int:
    """A worker's block table takes rank 0's rows (the rest of each row cleared); -> the index after them."""
    n = msg[at]
    slots = msg[at + 1 : at + 1 + n]
    width = msg[at + 1 + n]
    start = at + 2 + n
    rows = torch.tensor(msg[start : start + n * width], dtype=torch.long).view(n, width)
    for slot, row in zip(slots, rows):
        cache.block_table[slot].fill_(0)
        cache.block_table[slot, :width] = row
    return start + n * width


def encode_run(
    cache: KVCache, rows: list[RowInput], aux_layers: tuple[int, ...], aux_all: bool, hidden_all: bool
) -> torch.Tensor:
    """A RUN message: the forward's arguments and the block-table rows of its slots."""
    slots = sorted({r.slot for r in rows})
    msg = [
        RUN,
        int(aux_all),
        int(hidden_all),
        len(aux_layers),
        *aux_layers,
        *_table_rows(cache, slots),
        len(rows),
    ]
    for r in rows:
        n = len(r.token_ids)
        msg += [
            r.slot,
            r.start,
            n,
            r.logits_from,
            r.depths is not None,
            r.tree_mask is not None,
            *r.token_ids,
        ]
        if r.depths is not None:
            msg += list(r.depths)
        if r.tree_mask is not None:
            msg += r.tree_mask.reshape(-1).long().tolist()
    return torch.tensor(msg, dtype=torch.long)


def decode_run(cache: KVCache, msg: list[int]) -> tuple[list[RowInput], tuple[int, ...], bool, bool]:
    """A RUN message -> run's arguments (the block table updated on the way)."""
    aux_all, hidden_all, n_aux = bool(msg[1]), bool(msg[2]), msg[3]
    aux = tuple(msg[4 : 4 + n_aux])
    at = _apply_table_rows(cache, msg, 4 + n_aux)
    rows = []
    count, at = msg[at], at + 1
    for _ in range(count):
        slot, start, n, logits_from, has_depths, has_tree = msg[at : at + 6]
        at += 6
        row = RowInput(slot, start, msg[at : at + n], logits_from)
        at += n
        if has_depths:
            row.depths, at = msg[at : at + n], at + n
        if has_tree:
            row.tree_mask = torch.tensor(msg[at : at + n * n], dtype=torch.bool).view(n, n)
            at += n * n
        rows.append(row)
    return rows, aux, aux_all, hidden_all


class MirroredKVCache(KVCache):
    """Rank 0's cache: moves and copies of K/V are sent to the other ranks before they are done here."""

    group: TPGroup

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        self.group.broadcast(torch.tensor([MOVE, *_table_rows(self, [slot]), len(src), *src, *dst]))
        super().move(slot, src, dst)

    def copy_prefix(self, src: int, dst: list[int], n: int) -> None:
        if not dst or n <= 0:
            return
        for d in dst:
            if not self.grow(d, n):
                raise ValueError("the KV cache has too few free blocks for the copies")
        self.group.broadcast(torch.tensor([COPY, *_table_rows(self, [src, *dst]), n]))
        super().copy_prefix(src, dst, n)


def copy_blocks(cache: KVCache, src: int, dst: list[int], n: int) -> None:
    """A worker's copy_prefix: by the block table (a worker keeps no per-slot block lists)."""
    k = -(-n // cache.block_size)
    s = cache.block_table[src, :k]
    for d in dst:
        t = cache.block_table[d, :k]
        for kv in cache.kv:
            kv[t] = kv[s]


class TPModelRunner(ModelRunner):
    """Rank 0's ModelRunner: each forward is announced to the other ranks, then run by all of them."""

    def __init__(self, model, cache: MirroredKVCache, device: torch.device, group: TPGroup, workers=None):
        super().__init__(model, cache, device)
        self.group = cache.group = group
        # tp_worker.Workers: the processes of the other ranks (joined on close)
        self.workers = workers
        # a script that never calls LLM.shutdown still ends its ranks cleanly
        atexit.register(self.close)

    def run(
        self,
        rows: list[RowInput],
        aux_layers: tuple[int, ...] = (),
        aux_all: bool = False,
        hidden_all: bool = False,
    ) -> RunnerOutput:
        self.group.broadcast(encode_run(self.cache, rows, tuple(aux_layers), aux_all, hidden_all))
        return super().run(rows, aux_layers, aux_all, hidden_all)

    def close(self) -> None:
        """End the workers (they leave their loop) and the group."""
        if self.group.closed:
            return
        try:
            self.group.broadcast(torch.tensor([STOP]))
        except RuntimeError:
            # a rank already gone (it crashed, or was killed): nothing to tell it
            pass
        finally:
            self.group.close()
            if self.workers is not None:
                self.workers.join()


def serve_steps(runner: ModelRunner, group: TPGroup) -> None:
    """A worker's loop: run what rank 0 announces until STOP."""
    while apply_message(runner, group.broadcast(None).tolist()):
        pass


def apply_message(runner: ModelRunner, msg: list[int]) -> bool:
    """Do what one message of rank 0 says on this rank; False for STOP."""
    cache, op = runner.cache, msg[0]
    if op == RUN:
        rows, aux, aux_all, hidden_all = decode_run(cache, msg)
        runner.run(rows, aux, aux_all, hidden_all)
    elif op == MOVE:
        at = _apply_table_rows(cache, msg, 1)
        n = msg[at]
        cache.move(msg[2], msg[at + 1 : at + 1 + n], msg[at + 1 + n : at + 1 + 2 * n])
    elif op == COPY:
        at = _apply_table_rows(cache, msg, 1)
        n_slots = msg[1]
        copy_blocks(cache, msg[2], msg[3 : 2 + n_slots], msg[at])
    return op != STOP
