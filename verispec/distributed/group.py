"""A tensor-parallel rank's group: rendezvous on torch.distributed (gloo), then the collectives of a forward.

Ranks on one machine talk through a shared-memory channel (`verispec/kernels/comm.py`: an all-reduce of a decode
step's [1, hidden] partial sums costs microseconds there; gloo's costs a millisecond or more, 56 times a token on a
28-layer model). Ranks on different machines (or VERISPEC_TP_TRANSPORT=gloo) use gloo for everything. Either way
every rank ends an all-reduce with bitwise the same sum (rank order on shared memory; gloo reduces each element
once and shares the result).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from verispec.kernels.comm import ShmComm

# how long a rank waits for the others at start-up (rendezvous, the first barrier)
STARTUP_TIMEOUT_S = 60.0
# a worker waits this long for the engine's next step on gloo: an idle server sends none for hours
IDLE_TIMEOUT = timedelta(days=365)
# one all-reduce or gather waits this long for a peer before the group is declared broken
COLLECTIVE_TIMEOUT_S = 300.0

_ALLREDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class TPGroup:
    """Rank `rank` of `size`. Use `init_group` to make one."""

    def __init__(self, rank: int, size: int, shm: ShmComm | None, ops_group=None):
        self.rank, self.size, self.shm = rank, size, shm
        # gloo: the step broadcasts' group (a long timeout: a worker idles between requests)
        self._ops = ops_group
        # gloo: the C layers' all-reduce calls back into Python (kept alive here)
        self._callback = None if shm is not None else _ALLREDUCE_FN(self._allreduce_ptr)

    @property
    def transport(self) -> str:
        return "shm" if self.shm is not None else "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x (float32, contiguous, CPU) summed over the ranks, in place; the same bits on every rank."""
        if self.shm is not None:
            return self.shm.all_reduce(x)
        dist.all_reduce(x)
        return x

    def _allreduce_ptr(self, _ctx, ptr: int, n: int) -> int:
        buf = (ctypes.c_float * n).from_address(ptr)
        self.all_reduce(torch.frombuffer(buf, dtype=torch.float32))
        return 0

    def c_allreduce(self) -> tuple[int, int]:
        """(address of an `int32_t fn(void *ctx, float *x, int64_t n)` all-reduce, its ctx) for the C layers."""
        if self.shm is not None:
            return self.shm.allreduce_fn, self.shm.handle
        return ctypes.cast(self._callback, ctypes.c_void_p).value, 0

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """x [rows, widths[rank]] of every rank -> on rank 0 [rows, sum(widths)] in rank order; None elsewhere."""
        x = x.contiguous()
        if self.shm is not None:
            return self.shm.gather_columns(x, widths)
        if self.rank != 0:
            dist.gather(x, None, dst=0)
            return None
        parts = [x.new_empty(x.shape[0], w) for w in widths]
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=1)

    def broadcast(self, message: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's 1-D int64 `message` on every rank (others pass None). Workers wait here between steps."""
        if self.shm is not None:
            return self.shm.broadcast_tensor(message)
        n = torch.tensor([0 if message is None else message.numel()], dtype=torch.long)
        dist.broadcast(n, src=0, group=self._ops)
        if message is None:
            message = torch.empty(int(n), dtype=torch.long)
        dist.broadcast(message, src=0, group=self._ops)
        return message

    def barrier(self) -> None:
        if self.shm is not None:
            self.shm.barrier()
        else:
            dist.barrier()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()


def init_group(rank: int, size: int, init_method: str, timeout_s: float = STARTUP_TIMEOUT_S) -> TPGroup:
    """Join the tensor-parallel group at `init_method` (tcp://host:port or env://); ValueError naming
    distributed_init_method when the rendezvous cannot be reached in `timeout_s`."""
    try:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
        )
        ops = dist.new_group(list(range(size)), timeout=IDLE_TIMEOUT)
    except (RuntimeError, ValueError, OSError) as e:
        raise ValueError(
            f"tensor parallelism: rank {rank} of {size} could not join distributed_init_method={init_method!r} "
            f"within {timeout_s:g} s ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
    shm = _shared_memory(rank, size) if _same_machine(size) else None
    return TPGroup(rank, size, shm, ops)


def _same_machine(size: int) -> bool:
    """Whether every rank runs on this host (and shared memory is allowed)."""
    if os.environ.get("VERISPEC_TP_TRANSPORT", "shm") == "gloo":
        return False
    mine = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.long)
    hosts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(hosts, mine)
    return all(int(h) == int(mine) for h in hosts)


def _shared_memory(rank: int, size: int) -> ShmComm | None:
    """The shared-memory channel (rank 0 creates it, then the others attach), or None without the kernels."""
    name = torch.tensor([secrets.randbits(62) if rank == 0 else 0], dtype=torch.long)
    dist.broadcast(name, src=0)
    path = f"/dev/shm/verispec-tp-{int(name):x}"
    ok = torch.tensor([1], dtype=torch.long)
    shm = None
    try:
        if rank == 0:
            shm = ShmComm(path, rank, size, timeout_s=COLLECTIVE_TIMEOUT_S)
    except RuntimeError:
        ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank != 0 and int(ok):
        try:
            shm = ShmComm(path, rank, size, timeout_s=COLLECTIVE_TIMEOUT_S)
        except RuntimeError:
            ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok):
        if shm is not None:
            shm.close()
        return None
    return shm
