"""verispec/kernels/comm.py: the shared-memory channel of tensor-parallel ranks, between real processes.

The test process is rank 0 (it creates the segment), spawned children are the other ranks. Every rank checks its
own results against what it computes from every rank's seeded inputs: the all-reduce is bitwise the rank-order
sum (hence the same on every rank), the gathers and broadcasts are exact.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import threading
import time
import traceback
import uuid

import pytest
import torch

from verispec.kernels.build import load_qgemm
from verispec.kernels.comm import ShmComm

pytestmark = pytest.mark.skipif(load_qgemm() is None, reason="needs the native kernels")

# floats per rank and op: small, so that most ops below take several rounds
CAP = 1000


@pytest.fixture
def path(tmp_path):
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    out = os.path.join(folder, f"verispec-test-{uuid.uuid4().hex}")
    yield out
    if os.path.exists(out):
        os.unlink(out)


def _inputs(rank: int, seed: int, n: int) -> torch.Tensor:
    # other magnitudes per rank: another summation order would round differently
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g) * 10.0 ** (rank - 1)


def _rank_order_sum(world: int, seed: int, n: int) -> torch.Tensor:
    out = _inputs(0, seed, n)
    for r in range(1, world):
        out += _inputs(r, seed, n)
    return out


def _check_all_reduce(comm: ShmComm, seed: int, n: int, digest) -> None:
    x = _inputs(comm.rank, seed, n)
    assert comm.all_reduce(x) is x
    assert x.numpy().tobytes() == _rank_order_sum(comm.world, seed, n).numpy().tobytes(), (seed, n)
    digest.update(x.numpy().tobytes())


def _check_gather(comm: ShmComm, seed: int, rows: int, widths: list[int]) -> None:
    blocks = [_inputs(r, seed, rows * w).view(rows, w) for r, w in enumerate(widths)]
    out = comm.gather_columns(blocks[comm.rank], widths)
    if comm.rank == 0:
        assert torch.equal(out, torch.cat(blocks, dim=1)), (seed, rows, widths)
    else:
        assert out is None


def _check_broadcast(comm: ShmComm, seed: int, n: int) -> None:
    data = random.Random(seed).randbytes(n)
    assert comm.broadcast(data if comm.rank == 0 else None) == data


def _exercise(comm: ShmComm) -> str:
    """Every op, chunked and not, then 200 mixed ops; the digest of every all-reduce result."""
    digest = hashlib.sha256()
    for seed, n in enumerate((1, 1536, 2 * CAP + 37)):
        _check_all_reduce(comm, seed, n, digest)
    # rank 0's rows are wider than an op (split rows), rank 1's block takes three ops, rank 2's one
    _check_gather(comm, 10, 3, [1203, 901, 2][: comm.world])
    _check_gather(comm, 11, 9, [5, 301, 2][: comm.world])
    _check_broadcast(comm, 12, 8 * CAP + 123)
    sent = torch.arange(3000, dtype=torch.int64) * 7
    got = comm.broadcast_tensor(sent if comm.rank == 0 else None)
    assert torch.equal(got, sent)
    comm.barrier()
    for i in range(200):
        seed = 100 + i
        if i % 3 == 0:
            _check_all_reduce(comm, seed, 1 + (i * 37) % (2 * CAP + 100), digest)
        elif i % 3 == 1:
            _check_gather(comm, seed, 1 + i % 4, [1 + (i * (r + 3)) % 400 for r in range(comm.world)])
        else:
            _check_broadcast(comm, seed, (i * 53) % (5 * CAP))
    return digest.hexdigest()


def _attach_and_exercise(path: str, rank: int, world: int, queue) -> str:
    comm = ShmComm(path, rank, world, cap_floats=CAP, timeout_s=60)
    try:
        return _exercise(comm)
    finally:
        comm.close()


def _attach_and_exit(path: str, rank: int, world: int, queue) -> str:
    ShmComm(path, rank, world, cap_floats=CAP, timeout_s=60)
    return "attached"


def _attach_and_wait(path: str, rank: int, world: int, queue) -> str:
    comm = ShmComm(path, rank, world, cap_floats=CAP, timeout_s=60)
    queue.put((rank, "ok", "waiting"))
    try:
        comm.broadcast(None)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _child(fn, path: str, rank: int, world: int, queue) -> None:
    try:
        queue.put((rank, "ok", fn(path, rank, world, queue)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def _spawn(fn, path: str, world: int):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, path, r, world, queue)) for r in range(1, world)]
    for p in procs:
        p.start()
    return procs, queue


def _results(procs, queue, timeout_s: float = 120) -> dict[int, str]:
    out = {}
    for _ in procs:
        rank, status, value = queue.get(timeout=timeout_s)
        assert status == "ok", f"rank {rank}:\n{value}"
        out[rank] = value
    for p in procs:
        p.join(timeout=30)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_op_between_processes(path, world):
    comm = ShmComm(path, 0, world, cap_floats=CAP, timeout_s=60)
    procs, queue = _spawn(_attach_and_exercise, path, world)
    try:
        mine = _exercise(comm)
        # every rank's all-reduce results, bit for bit
        assert set(_results(procs, queue).values()) == {mine}
    finally:
        comm.close()
        for p in procs:
            p.kill()
    assert not os.path.exists(path)


def test_a_peer_that_exits_fails_the_op_quickly(path):
    comm = ShmComm(path, 0, 2, cap_floats=CAP, timeout_s=2)
    procs, queue = _spawn(_attach_and_exit, path, 2)
    try:
        assert _results(procs, queue) == {1: "attached"}
        start = time.monotonic()
        with pytest.raises(
            RuntimeError, match=r"rank 0 of 2: a peer process stopped responding \(rank 1 exited\)"
        ):
            comm.all_reduce(torch.ones(1536))
        assert time.monotonic() - start < 1.5
        # and the channel stays failed
        with pytest.raises(RuntimeError, match="stopped responding"):
            comm.barrier()
    finally:
        comm.close()


def test_a_peer_that_never_comes_times_out(path):
    comm = ShmComm(path, 0, 2, cap_floats=CAP, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"stopped responding \(timed out after 0.5 s\)"):
        comm.all_reduce(torch.ones(10))
    assert 0.5 <= time.monotonic() - start < 2
    comm.close()
    comm.close()


def test_close_wakes_a_waiting_receiver(path):
    comm = ShmComm(path, 0, 2, cap_floats=CAP, timeout_s=60)
    procs, queue = _spawn(_attach_and_wait, path, 2)
    try:
        assert queue.get(timeout=120) == (1, "ok", "waiting")
        time.sleep(0.3)
        comm.close()
        start = time.monotonic()
        assert _results(procs, queue, timeout_s=10) == {
            1: "tensor-parallel rank 1 of 2: the channel was closed"
        }
        assert time.monotonic() - start < 5
    finally:
        for p in procs:
            p.kill()
    with pytest.raises(RuntimeError, match="closed"):
        comm.barrier()


def test_close_from_another_thread_while_an_op_waits(path):
    """A rank's own close, while one of its threads waits in an op, ends that op ('closed') without unmapping the
    segment under it."""
    root = ShmComm(path, 0, 2, cap_floats=CAP, timeout_s=60)
    peer = ShmComm(path, 1, 2, cap_floats=CAP, timeout_s=60)
    errors = []

    def wait():
        try:
            peer.broadcast_tensor(None)
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.2)
    peer.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and errors == ["tensor-parallel rank 1 of 2: the channel was closed"]
    with pytest.raises(RuntimeError, match="closed"):
        root.barrier()
    root.close()
