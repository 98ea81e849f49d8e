"""A shared-memory channel between the tensor-parallel ranks of one machine (comm.c in the kernel library).

Every rank maps one /dev/shm file; an all-reduce of a decode step's partial sums costs microseconds there where
gloo's costs a millisecond. Each op is a barrier of all ranks and every rank makes the same ops in the same order.
The all-reduce sums in rank order 0, 1, .., world - 1 on every rank, so every rank ends with the same bits.

Rank 0 creates the file; the others attach to it, so rank 0's constructor must have returned before the others
construct theirs (order them with a barrier of your own, e.g. torch.distributed's). A waiting rank notices a peer
that exited (RuntimeError) and the channel's close (RuntimeError). Without the native kernels (no compiler, no
AVX2, VERISPEC_KERNELS=0) the constructor raises RuntimeError: callers fall back to gloo.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
import weakref

import torch

from verispec.kernels.build import load_qgemm


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class ShmComm:
    """Rank `rank` of `world` on the segment at `path` (a /dev/shm file); ops larger than `cap_floats` floats per
    rank go in several rounds. `timeout_s` bounds each all-reduce, gather and barrier (<= 0: no bound).

    `allreduce_fn` (the address of `int32_t shm_allreduce_f32(void *c, float *x, int64_t n)`) and `handle` (its
    `c`) let C code all-reduce without Python; they are valid until `close`."""

    def __init__(
        self, path: str, rank: int, world: int, cap_floats: int = 1 << 20, timeout_s: float = 300.0
    ) -> None:
        if not 0 <= rank < world or cap_floats < 1:
            raise ValueError(
                f"ShmComm: rank {rank} of world {world} with cap {cap_floats} floats is not valid"
            )
        lib = load_qgemm()
        if lib is None:
            raise RuntimeError(
                "the shared-memory tensor-parallel channel needs the native kernels (verispec/kernels/build.py: "
                "a C compiler and an AVX2 CPU, VERISPEC_KERNELS not 0)"
            )
        self._lib, self.path, self.rank, self.world = lib, path, rank, world
        self.cap, self.timeout_s = cap_floats, timeout_s
        self._failure: str | None = None
        self._nbytes = lib.shm_segment_bytes(world, cap_floats)
        self._struct = ctypes.create_string_buffer(lib.shm_comm_size())
        self.handle: int = ctypes.addressof(self._struct)
        self.allreduce_fn: int = ctypes.cast(lib.shm_allreduce_f32, ctypes.c_void_p).value
        # the mapping, seen as a ctypes array; each op holds a reference while in C (a close from another thread
        # then unmaps only once that op has returned)
        self._view = self._create() if rank == 0 else self._attach()
        # rank 0 removes the file once every rank has it mapped (its first op) or at close, whichever is first
        self._unlink = weakref.finalize(self, _unlink_quietly, path) if rank == 0 else None

    def _map(self, fd: int):
        mm = mmap.mmap(fd, self._nbytes)
        return mm, (ctypes.c_char * self._nbytes).from_buffer(mm)

    def _init(self, view, create: int) -> int:
        return self._lib.shm_comm_init(
            self.handle,
            ctypes.addressof(view),
            self.rank,
            self.world,
            self.cap,
            float(self.timeout_s),
            create,
        )

    def _create(self):
        # built under a temporary name, then renamed: an attaching rank never sees a half-made segment
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS mid-step
                os.posix_fallocate(fd, 0, self._nbytes)
                mm, view = self._map(fd)
            finally:
                os.close(fd)
            if self._init(view, 1) != 0:
                raise OSError("shm_comm_init refused the segment")
            os.replace(tmp, self.path)
        except OSError as e:
            _unlink_quietly(tmp)
            raise RuntimeError(
                f"tensor-parallel rank 0: cannot create the shared-memory channel {self.path} "
                f"({self._nbytes} bytes): {e}"
            ) from None
        return view

    def _attach(self):
        deadline = time.monotonic() + max(self.timeout_s, 1.0)
        error = "it does not exist"
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR)
                try:
                    size = os.fstat(fd).st_size
                    if size == self._nbytes:
                        mm, view = self._map(fd)
                        if self._init(view, 0) == 0:
                            return view
                        error = "its header does not match (world, cap)"
                        del view, mm
                    else:
                        error = f"it has {size} bytes, not {self._nbytes}"
                finally:
                    os.close(fd)
            except OSError as e:
                error = str(e)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel rank {self.rank}: cannot attach to the shared-memory channel {self.path} "
                    f"({error}); rank 0 must create it first"
                )
            time.sleep(0.01)

    def _check(self, rc: int, timeout_s: float) -> None:
        if rc == 0:
            if self._unlink is not None and self._unlink.alive:
                self._unlink()
            return
        if self._failure is None:
            if rc == -2:
                self._failure = "the channel was closed"
            else:
                dead = self._lib.shm_comm_dead_rank(self.handle)
                reason = f"rank {dead} exited" if dead >= 0 else f"timed out after {timeout_s:g} s"
                self._failure = f"a peer process stopped responding ({reason})"
        raise RuntimeError(f"tensor-parallel rank {self.rank} of {self.world}: {self._failure}")

    def _mapping(self):
        view = self._view
        if view is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} of {self.world}: the channel was closed")
        return view

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x (float32, contiguous, CPU) summed over the ranks in rank order, in place; returns x."""
        if not (x.is_cpu and x.dtype is torch.float32 and x.is_contiguous()):
            raise ValueError(
                f"ShmComm.all_reduce: needs a contiguous float32 CPU tensor, got {x.dtype} {x.device}"
            )
        view = self._mapping()  # noqa: F841 (keeps the mapping alive during the call)
        self._check(self._lib.shm_allreduce_f32(self.handle, x.data_ptr(), x.numel()), self.timeout_s)
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Every rank's x [rows, widths[rank]] (float32, CPU) -> on rank 0 [rows, sum(widths)], the blocks side by
        side in rank order; None on the others."""
        if len(widths) != self.world or x.dim() != 2 or x.shape[1] != widths[self.rank]:
            raise ValueError(
                f"ShmComm.gather_columns: x {tuple(x.shape)} on rank {self.rank} does not match widths {widths}"
            )
        if not (x.is_cpu and x.dtype is torch.float32):
            raise ValueError(f"ShmComm.gather_columns: needs a float32 CPU tensor, got {x.dtype} {x.device}")
        x = x.contiguous()
        rows, total = x.shape[0], sum(widths)
        out = x.new_empty(rows, total) if self.rank == 0 else None
        view = self._mapping()  # noqa: F841
        rc = self._lib.shm_gather_f32(
            self.handle,
            x.data_ptr(),
            rows,
            x.shape[1],
            None if out is None else out.data_ptr(),
            total,
            sum(widths[: self.rank]),
        )
        self._check(rc, self.timeout_s)
        return out

    def _broadcast_length(self, n: int, timeout_s: float) -> int:
        length = ctypes.c_int64(n)
        view = self._mapping()  # noqa: F841
        self._check(
            self._lib.shm_broadcast(self.handle, ctypes.addressof(length), 8, float(timeout_s)), timeout_s
        )
        return length.value

    def _broadcast_payload(self, ptr: int, nbytes: int) -> None:
        view = self._mapping()  # noqa: F841
        # rank 0 sends the payload right after the length: the usual timeout applies
        self._check(self._lib.shm_broadcast(self.handle, ptr, nbytes, float(self.timeout_s)), self.timeout_s)

    def broadcast(self, data: bytes | None, timeout_s: float = 0) -> bytes:
        """Rank 0's `data` on every rank (the others pass None). Waits up to timeout_s for the others (<= 0: for
        ever, e.g. a worker idle between requests; a peer's exit or the channel's close still ends the wait)."""
        if self.rank == 0:
            if data is None:
                raise ValueError("ShmComm.broadcast: rank 0 sends bytes, not None")
            data = bytes(data)
        n = self._broadcast_length(len(data) if self.rank == 0 else 0, timeout_s)
        if self.rank == 0:
            if n:
                self._broadcast_payload(ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value, n)
            return data
        buf = ctypes.create_string_buffer(max(n, 1))
        if n:
            self._broadcast_payload(ctypes.addressof(buf), n)
        return buf.raw[:n]

    def broadcast_tensor(self, t: torch.Tensor | None, timeout_s: float = 0) -> torch.Tensor:
        """Rank 0's 1-D int64 tensor `t` on every rank (the others pass None and get a new tensor); the wait as in
        `broadcast`."""
        if self.rank == 0:
            if t is None or t.dim() != 1 or t.dtype is not torch.int64 or not t.is_cpu:
                raise ValueError("ShmComm.broadcast_tensor: rank 0 sends a 1-D int64 CPU tensor")
            t = t.contiguous()
        n = self._broadcast_length(t.numel() if self.rank == 0 else 0, timeout_s)
        if self.rank != 0:
            t = torch.empty(n, dtype=torch.int64)
        if n:
            self._broadcast_payload(t.data_ptr(), 8 * n)
        return t

    def broadcast_into(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x copied into every rank's x (contiguous, CPU, the same size everywhere); returns x."""
        if not (x.is_cpu and x.is_contiguous()):
            raise ValueError(f"ShmComm.broadcast_into: needs a contiguous CPU tensor, got {x.device}")
        if x.numel():
            self._broadcast_payload(x.data_ptr(), x.numel() * x.element_size())
        return x

    def barrier(self) -> None:
        view = self._mapping()  # noqa: F841
        self._check(self._lib.shm_barrier(self.handle), self.timeout_s)

    def close(self) -> None:
        """Wake every rank waiting on the channel (their ops raise 'closed'), unmap it; rank 0 removes the file.
        Idempotent. `allreduce_fn` / `handle` must not be used afterwards."""
        view = self._view
        if view is None:
            return
        self._lib.shm_close(self.handle)
        # the mapping goes once no op holds it (an op in another thread returns 'closed' first)
        self._view = None
        del view
        if self._unlink is not None:
            self._unlink()

    def __enter__(self) -> ShmComm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
