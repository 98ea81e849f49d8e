"""The tensor-parallel ranks other than 0: processes started by the engine (one per rank, `launch`), each loading
its shard of the target and its part of the KV cache, then running the forwards rank 0 announces (tp.serve_steps).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch

from verispec.distributed.cpus import bind_process
from verispec.distributed.group import TPGroup, init_group
from verispec.kernels.ops import KV_DTYPE_CODES
from verispec.loader.checkpoint import Checkpoint, load_checkpoint
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner
from verispec.runner.tp import PLAN, serve_steps


@dataclass(frozen=True)
class RankSpec:
    """What one rank needs to load its shard (plain values: it crosses to a new process)."""

    model: str
    device: str
    dtype: str
    keep_quantized: bool
    activation_dtype: str
    rank: int
    size: int
    init_method: str
    threads: int
    # the cores its threads run on (distributed/cpus.py; empty: wherever the OS puts them)
    cpus: tuple[int, ...] = ()
    # the machines the group spans (size / nodes consecutive ranks each)
    nodes: int = 1


def free_init_method() -> str:
    """tcp://127.0.0.1:<a free port>: the rendezvous of ranks that all run on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def check_threads(size: int, threads: int | None) -> int:
    """Threads per rank: `threads` (the engine's, default one per usable core) shared out; ValueError naming
    tensor_parallel_size when there are more ranks than cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if size > cores:
        raise ValueError(
            f"tensor_parallel_size={size} is more ranks than this machine's {cores} usable CPU cores; "
            f"use at most {cores}"
        )
    return max(1, (threads or cores) // size)


def agree_loaded(group: TPGroup, ok: bool) -> bool:
    """Every rank says whether it loaded its shard; True if all did (waits for the slowest rank's load)."""
    return group.agree(ok)


def _say(errors, text: str) -> None:
    errors.write(text.encode())
    errors.flush()


def worker_main(spec: RankSpec, errors) -> None:
    """One rank's process: join, load, take the cache plan, then serve rank 0's steps until it stops."""
    if spec.cpus:
        # before the load, so that the shard is first touched (placed) on the node of these cores
        bind_process(list(spec.cpus))
    torch.set_num_threads(spec.threads)
    try:
        group = init_group(spec.rank, spec.size, spec.init_method, nodes=spec.nodes)
    except ValueError as e:
        _say(errors, f"rank {spec.rank}: {e}")
        return
    try:
        ckpt = load_checkpoint(
            spec.model,
            torch.device(spec.device),
            spec.dtype,
            skip_tokenizer_init=True,
            keep_quantized=spec.keep_quantized,
            activation_dtype=spec.activation_dtype,
            tp=group,
        )
    except Exception as e:
        _say(errors, f"rank {spec.rank}: {type(e).__name__}: {e}")
        agree_loaded(group, False)
        group.close()
        return
    if not agree_loaded(group, True):
        group.close()
        return
    try:
        cache = worker_cache(ckpt, group)
        if cache is not None:
            serve_steps(ModelRunner(ckpt.model, cache, torch.device(spec.device)), group)
    except RuntimeError as e:
        # rank 0 went away (it crashed or was killed): one line, not a traceback
        print(f"verispec: tensor-parallel rank {spec.rank} stops: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        group.close()


def worker_cache(ckpt: Checkpoint, group: TPGroup) -> KVCache | None:
    """This rank's KV cache (its KV heads) on rank 0's plan, which rank 0 sends (None: STOP instead, rank 0's
    start-up failed after the load)."""
    msg = group.broadcast(None).tolist()
    if msg[0] != PLAN:
        return None
    num_slots, t_alloc, num_blocks, block_size, kv_code = msg[1:]
    dtype = next(d for d, c in KV_DTYPE_CODES.items() if c == kv_code)
    device = ckpt.model.embed_tokens.weight.device
    return KVCache(ckpt.model.cfg, num_slots, t_alloc, device, dtype, num_blocks, block_size)


def send_plan(group: TPGroup, cache: KVCache) -> None:
    """Rank 0's half of worker_cache."""
    kv_code = KV_DTYPE_CODES[cache.kv[0].dtype]
    plan = [PLAN, cache.num_slots, cache.t_alloc, cache.pool.num_blocks, cache.block_size, kv_code]
    group.broadcast(torch.tensor(plan, dtype=torch.long))


@dataclass
class Workers:
    """The processes of ranks 1 .. size - 1 and the pipes their start-up errors come back on."""

    procs: list[subprocess.Popen]
    errors: list[int]
    # the cores rank 0's process could use before it was bound to its own (put back by join)
    rank0_cores: set[int] | None = None

    def failures(self) -> str:
        """What the workers reported (or that they exited) when start-up failed."""
        said = []
        for i, (p, fd) in enumerate(zip(self.procs, self.errors)):
            if select.select([fd], [], [], 1.0)[0]:
                text = os.read(fd, 1 << 16).decode(errors="replace").strip()
                if text:
                    said.append(text)
                    continue
            if p.poll() is not None:
                said.append(f"rank {i + 1} exited with code {p.returncode}")
        return "; ".join(said) or "a worker did not answer"

    def join(self, timeout: float | None = 30.0) -> None:
        """Wait for every rank to end (None: however long), killing those still running after `timeout`."""
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for fd in self.errors:
            os.close(fd)
        self.errors = []
        if self.rank0_cores is not None:
            bind_process(sorted(self.rank0_cores))
            self.rank0_cores = None


def launch(specs: list[RankSpec]) -> Workers:
    """Start one process per spec: a fresh interpreter running this module (never a re-import of the user's
    script, so no `if __name__ == "__main__"` guard is needed), its start-up errors written to a pipe."""
    procs, errors = [], []
    for spec in specs:
        read, write = os.pipe()
        entry = "import sys; from verispec.runner.tp_worker import main; main(sys.argv[1:])"
        cmd = [sys.executable, "-c", entry, json.dumps(asdict(spec)), str(write)]
        procs.append(subprocess.Popen(cmd, pass_fds=(write,), stdin=subprocess.DEVNULL))
        os.close(write)
        errors.append(read)
    return Workers(procs, errors)


def main(argv: list[str]) -> None:
    # Ctrl-C reaches the whole process group: rank 0 decides when the ranks stop (STOP, or its exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = RankSpec(**json.loads(argv[0]))
    with os.fdopen(int(argv[1]), "wb") as errors:
        worker_main(spec, errors)
