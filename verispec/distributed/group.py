"""A tensor-parallel rank's group: rendezvous on torch.distributed (gloo), then the collectives of a forward.

Ranks on one machine talk through a shared-memory channel (`verispec/kernels/comm.py`: an all-reduce of a decode
step's [1, hidden] partial sums costs microseconds there; gloo's costs a millisecond or more, 56 times a token on a
28-layer model). A group over several machines ("nodes") with more than one rank on each all-reduces in three
legs: each node's ranks sum on their own channel, the nodes' first ranks all-reduce those sums over gloo, and each
passes the result to its node's other ranks on the channel; everything else goes over gloo. With one rank a node
(or VERISPEC_TP_TRANSPORT=gloo) gloo carries everything. Either way every rank ends an all-reduce with bitwise the
same sum (rank order on shared memory; gloo reduces each element once and shares the result).
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

    def __init__(self, rank: int, size: int, shm: ShmComm | None, pg, ops_pg, node_shm=None, leaders=None):
        self.rank, self.size, self.shm = rank, size, shm
        # gloo: the collectives' group, and the step broadcasts' (a long timeout: a worker idles between requests).
        # Groups of their own, not torch.distributed's default one: a process may hold several engines in turn
        self.pg, self._ops = pg, ops_pg
        # several nodes of several ranks: this node's channel, and (on a node's first rank) the nodes' gloo group
        self.node_shm, self.leaders = node_shm, leaders
        # gloo (and the three legs): the C layers' all-reduce calls back into Python (kept alive here)
        self._callback = None if shm is not None else _ALLREDUCE_FN(self._allreduce_ptr)

    @property
    def closed(self) -> bool:
        return self.pg is None

    @property
    def transport(self) -> str:
        if self.shm is not None:
            return "shm"
        return "shm+gloo" if self.node_shm is not None else "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x (float32, contiguous, CPU) summed over the ranks, in place; the same bits on every rank."""
        if self.shm is not None:
            return self.shm.all_reduce(x)
        if self.node_shm is not None:
            # this node's sum, then the nodes' sum among their first ranks, then that on every rank of the node
            self.node_shm.all_reduce(x)
            if self.leaders is not None:
                self._wait(self.leaders.allreduce, [x])
            return self.node_shm.broadcast_into(x)
        self._wait(self.pg.allreduce, [x])
        return x

    def _wait(self, collective, *args) -> None:
        """A gloo collective, its failure (a peer gone: gloo reports a closed connection) named like shared
        memory's."""
        try:
            collective(*args).wait()
        except RuntimeError as e:
            raise RuntimeError(
                f"tensor-parallel rank {self.rank} of {self.size}: a peer process stopped responding "
                f"({str(e).splitlines()[0][:200]})"
            ) from None

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
        opts = dist.GatherOptions()
        opts.rootRank = 0
        # gloo gathers equal sizes only: every block padded to the widest
        wide = max(widths)
        if x.shape[1] < wide:
            x = torch.cat((x, x.new_zeros(x.shape[0], wide - x.shape[1])), dim=1)
        if self.rank != 0:
            self._wait(self.pg.gather, [], [x], opts)
            return None
        parts = [x.new_empty(x.shape[0], wide) for _ in widths]
        self._wait(self.pg.gather, [parts], [x], opts)
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)

    def broadcast(self, message: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's 1-D int64 `message` on every rank (others pass None). Workers wait here between steps."""
        if self.shm is not None:
            return self.shm.broadcast_tensor(message)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        n = torch.tensor([0 if message is None else message.numel()], dtype=torch.long)
        self._wait(self._ops.broadcast, [n], opts)
        if message is None:
            message = torch.empty(int(n), dtype=torch.long)
        self._wait(self._ops.broadcast, [message], opts)
        return message

    def agree(self, ok: bool) -> bool:
        """Every rank says yes or no; True if all said yes (waits for the slowest rank: a load)."""
        flag = torch.tensor([int(ok)], dtype=torch.long)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._ops.allreduce([flag], opts).wait()
        return bool(int(flag))

    def barrier(self) -> None:
        if self.shm is not None:
            self.shm.barrier()
        else:
            self.pg.barrier().wait()

    def close(self) -> None:
        for channel in (self.shm, self.node_shm):
            if channel is not None:
                channel.close()
        self.shm = self.node_shm = None
        self.pg = self._ops = self.leaders = None


def init_group(
    rank: int, size: int, init_method: str, timeout_s: float | None = None, nodes: int = 1
) -> TPGroup:
    """Join the tensor-parallel group at `init_method` (tcp://host:port, or env:// with MASTER_ADDR and
    MASTER_PORT; rank 0 serves the rendezvous) of `size` ranks on `nodes` machines (size / nodes consecutive ranks
    each); ValueError naming distributed_init_method when it cannot be reached within `timeout_s` (default
    STARTUP_TIMEOUT_S)."""
    timeout = timedelta(seconds=STARTUP_TIMEOUT_S if timeout_s is None else timeout_s)
    host, port = _address(init_method)
    try:
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
        pg = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, timeout)
        ops = dist.ProcessGroupGloo(dist.PrefixStore("ops", store), rank, size, IDLE_TIMEOUT)
    except (RuntimeError, ValueError, OSError) as e:
        raise ValueError(
            f"tensor parallelism: rank {rank} of {size} could not join distributed_init_method={init_method!r} "
            f"within {timeout.total_seconds():g} s ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
    if nodes > 1:
        node_shm, leaders = _node_channels(store, pg, rank, size, nodes, timeout)
        return TPGroup(rank, size, None, pg, ops, node_shm, leaders)
    shm = _shared_memory(pg, rank, size) if _same_machine(pg, size) else None
    return TPGroup(rank, size, shm, pg, ops)


def _address(init_method: str) -> tuple[str, int]:
    if init_method == "env://":
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ValueError(
                "distributed_init_method='env://' needs MASTER_ADDR and MASTER_PORT in the environment"
            )
    else:
        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    if not port.isdigit() or not host:
        raise ValueError(f"distributed_init_method must be tcp://host:port or env://, got {init_method!r}")
    return host.strip("[]"), int(port)


def _broadcast(pg, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()


def _same_machine(pg, size: int) -> bool:
    """Whether every rank runs on this host (and shared memory is allowed)."""
    if os.environ.get("VERISPEC_TP_TRANSPORT", "shm") == "gloo":
        return False
    mine = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.long)
    hosts = [torch.empty_like(mine) for _ in range(size)]
    pg.allgather([hosts], [mine]).wait()
    return all(int(h) == int(mine) for h in hosts)


def _shared_memory(pg, rank: int, size: int) -> ShmComm | None:
    """The shared-memory channel (rank 0 creates it, then the others attach), or None without the kernels."""
    name = torch.tensor([secrets.randbits(62) if rank == 0 else 0], dtype=torch.long)
    _broadcast(pg, name)
    path = f"/dev/shm/verispec-tp-{int(name):x}"
    ok = torch.tensor([1], dtype=torch.long)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    shm = None
    try:
        if rank == 0:
            shm = ShmComm(path, rank, size, timeout_s=COLLECTIVE_TIMEOUT_S)
    except RuntimeError:
        ok.zero_()
    pg.allreduce([ok], opts).wait()
    if rank != 0 and int(ok):
        try:
            shm = ShmComm(path, rank, size, timeout_s=COLLECTIVE_TIMEOUT_S)
        except RuntimeError:
            ok.zero_()
    pg.allreduce([ok], opts).wait()
    if not int(ok):
        if shm is not None:
            shm.close()
        return None
    return shm


def _node_channels(store, pg, rank: int, size: int, nodes: int, timeout: timedelta):
    """Several nodes of several ranks (the node's first rank creates its channel and says its name in the store):
    (this node's ShmComm, the nodes' gloo group on a node's first rank, else None), or (None, None) when any node
    cannot have a channel (every rank must take the same path) or VERISPEC_TP_TRANSPORT=gloo."""
    local = size // nodes
    node, local_rank = divmod(rank, local)
    ok = torch.tensor([int(local > 1 and os.environ.get("VERISPEC_TP_TRANSPORT", "shm") != "gloo")])
    names = dist.PrefixStore("node-shm", store)
    shm = None
    if int(ok):
        try:
            if local_rank == 0:
                path = f"/dev/shm/verispec-tp-{secrets.randbits(62):x}"
                shm = ShmComm(path, 0, local, timeout_s=COLLECTIVE_TIMEOUT_S)
                names.set(str(node), path)
            else:
                path = names.get(str(node)).decode()
                shm = ShmComm(path, local_rank, local, timeout_s=COLLECTIVE_TIMEOUT_S) if path else None
        except RuntimeError:
            if local_rank == 0:
                names.set(str(node), "")
        ok = torch.tensor([int(shm is not None)])
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    pg.allreduce([ok], opts).wait()
    if not int(ok):
        if shm is not None:
            shm.close()
        return None, None
    leaders = None
    if local_rank == 0:
        leaders = dist.ProcessGroupGloo(dist.PrefixStore("leaders", store), node, nodes, timeout)
    return shm, leaders
