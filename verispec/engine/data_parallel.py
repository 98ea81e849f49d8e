"""Data parallelism: `data_parallel_size` engine replicas (one process each, engine/replica.py) behind one front end
with the engine's interface, so `LLM` and the server's engine thread drive it as they drive one engine.

Requests go to a replica by cached prefix, then by load (`PrefixRouter`): a chat's next turn goes to the replica
that holds its history, unless that replica is much busier than the others. Counters and gauges are the sum over the
replicas. A replica that dies (or whose step fails) fails only its own requests; the others keep serving.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection, wait

import torch

from verispec.distributed.cpus import rank_cores
from verispec.engine.args import EngineArgs
from verispec.engine.engine import SchedulerStats, check_request
from verispec.engine.options import EngineOptions
from verispec.engine.replica import ReplicaInfo, replica_args
from verispec.metrics import EngineCounters, SpecDecodingStats
from verispec.outputs import RequestOutput
from verispec.sample.grammar import GrammarState, LazyGrammars

# a replica waits this long for its engine to load
READY_TIMEOUT_S = 600.0
# step() waits this long for outputs before handing control back (the server's loop then takes new requests)
POLL_S = 0.005


class PrefixRouter:
    """Which replica gets a prompt: the one that was given the longest run of its leading blocks (its prefix cache
    likely holds them), unless it has more than `slack` requests in flight beyond the least loaded replica; else the
    least loaded one (ties: the one given fewest requests). Remembers up to `capacity` block hashes."""

    def __init__(self, n: int, block_size: int = 16, slack: int = 4, capacity: int = 1 << 16):
        self.n, self.block_size, self.slack, self.capacity = n, block_size, slack, capacity
        # chained hash of a prompt's first k blocks -> the replica last given them (LRU)
        self._owner: OrderedDict[int, int] = OrderedDict()
        self.given = [0] * n

    def _hashes(self, ids: list[int]) -> list[int]:
        b, h, out = self.block_size, 0, []
        for i in range(0, len(ids) - len(ids) % b, b):
            h = hash((h, tuple(ids[i : i + b])))
            out.append(h)
        return out

    def route(self, ids: list[int], loads: list[int], alive: list[bool]) -> int:
        """The replica for prompt `ids`, given each replica's requests in flight and whether it is up."""
        live = [i for i in range(self.n) if alive[i]]
        if not live:
            raise RuntimeError("no data-parallel replica is running")
        least = min(live, key=lambda i: (loads[i], self.given[i], i))
        hashes = self._hashes(ids)
        pick = least
        for h in reversed(hashes):
            owner = self._owner.get(h)
            if owner is not None and alive[owner]:
                if loads[owner] <= loads[least] + self.slack:
                    pick = owner
                break
        for h in hashes:
            self._owner[h] = pick
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        self.given[pick] += 1
        return pick


class ReplicaFailed(RuntimeError):
    """A replica died or failed a step; `request_ids` are the requests that were on it."""

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = request_ids


@dataclass
class Replica:
    index: int
    proc: subprocess.Popen
    conn: Connection
    alive: bool = True
    # requests sent and not finished
    requests: set[str] = field(default_factory=set)
    counters: EngineCounters = field(default_factory=EngineCounters)
    stats: SchedulerStats | None = None


def replica_devices(device: str, n: int, gpus: int) -> list[str]:
    """Where each of n replicas runs, given the machine's GPU count: the CPU, or the GPUs in turn (replica i on GPU
    i mod gpus; `cuda:k` puts every replica on GPU k)."""
    if device == "cpu" or (device == "auto" and gpus == 0):
        return ["cpu"] * n
    if gpus == 0:
        raise ValueError(f"device={device!r} was requested but CUDA is not available")
    if device.startswith("cuda:"):
        return [device] * n
    return [f"cuda:{i % gpus}" for i in range(n)]


def start_replicas(args: EngineArgs) -> list[Replica]:
    """data_parallel_size processes, each building its engine on its device with its share of the threads
    (ValueError naming the setting: more CPU replicas x ranks than cores, GPUs shared without a KV budget)."""
    n, tp = args.data_parallel_size, args.tensor_parallel_size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    gpus = torch.cuda.device_count() if args.device != "cpu" else 0
    devices = replica_devices(args.device, n, gpus)
    if devices[0] == "cpu" and n * tp > cores:
        raise ValueError(
            f"data_parallel_size={n} x tensor_parallel_size={tp} is more processes than this machine's {cores} "
            f"usable CPU cores; use at most {cores // tp} replicas"
        )
    if devices[0] != "cpu" and len(set(devices)) < n and args.kv_cache_memory_bytes is None:
        # each replica's default budget is a share of the memory free when it looks, which the others are taking
        raise ValueError(
            f"data_parallel_size={n} puts more than one replica on {devices[0]} ({gpus} GPU(s)): set "
            "kv_cache_memory_bytes, each replica's KV cache budget, so that they fit in its memory together"
        )
    threads = max(1, (args.threads or cores) // n)
    # CPU replicas on cores of their own, as tensor-parallel ranks are (one NUMA node each where there are enough)
    bound = (rank_cores(n) if devices[0] == "cpu" else None) or [[] for _ in devices]
    # explicit VERISPEC_CPU_BIND lists are the replicas': a replica's own ranks split its cores
    env = dict(os.environ)
    if env.get("VERISPEC_CPU_BIND", "auto") not in ("auto", "none"):
        env["VERISPEC_CPU_BIND"] = "auto"
    entry = "import sys; from verispec.engine.replica import main; main(sys.argv[1:])"
    replicas = []
    for i, (device, cpus) in enumerate(zip(devices, bound)):
        mine, theirs = socket.socketpair()
        replica_threads = min(threads, len(cpus)) if cpus else threads
        fields = replica_args(args, replica_threads, device)
        cmd = [sys.executable, "-c", entry, fields, str(theirs.fileno()), ",".join(map(str, cpus))]
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        replicas.append(Replica(i, proc, Connection(mine.detach())))
    return replicas


def wait_ready(replicas: list[Replica]) -> ReplicaInfo:
    """Every replica's ("ready", info); ValueError with the first one's error if any failed to start."""
    info = None
    for r in replicas:
        if not r.conn.poll(READY_TIMEOUT_S):
            raise ValueError(f"data-parallel replica {r.index} did not start within {READY_TIMEOUT_S:g} s")
        try:
            msg = r.conn.recv()
        except EOFError:
            raise ValueError(f"data-parallel replica {r.index} exited with code {r.proc.wait()}") from None
        if msg[0] == "error":
            raise ValueError(msg[1])
        info = info or msg[1]
    return info


class DataParallelEngine:
    """The replicas behind LLMEngine's interface (add_request, step, abort_request, release, stats, counters)."""

    def __init__(self, args: EngineArgs):
        self.replicas = start_replicas(args)
        try:
            info = wait_ready(self.replicas)
        except BaseException:
            self.close()
            raise
        self.info = info
        self.tokenizer, self.speculative_config = info.tokenizer, info.speculative_config
        self.eos_token_ids = info.eos_token_ids
        self.opts = EngineOptions(max_model_len=info.max_model_len, spec_metrics=info.spec_metrics)
        self.device, self.checkpoint, self.spec_log = torch.device("cpu"), None, None
        # LLM.generate sets it while its requests run (read by one engine's planner; nothing to do here)
        self.closed = False
        self.router = PrefixRouter(len(self.replicas), info.block_size)
        self._where: dict[str, Replica] = {}
        self._failed: list[str] = []
        self._pending: list[RequestOutput] = []
        self._grammars = LazyGrammars(info.tokenizer, info.vocab_size, info.eos_token_ids)

    # ------------------------------------------------------------------ requests
    def grammar_for(self, params) -> GrammarState | None:
        """Compiled here to refuse a bad constraint at once (HTTP 400); the replica compiles its own matcher."""
        return self._grammars.matcher_for(params)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params,
        bad_words_token_ids: list[list[int]] | None = None,
        cache_salt: str | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        """Validate here (ValueError at once, as one engine would), then send to the routed replica. The replica
        tokenizes bad words and compiles the grammar itself (they do not cross processes)."""
        if request_id in self._where:
            raise ValueError(f"request_id {request_id!r} is already in use")
        info = self.info
        check_request(
            prompt_token_ids, params, info.max_model_len, info.vocab_size, self.tokenizer is not None
        )
        if grammar is None:
            self.grammar_for(params)
        loads = [len(r.requests) for r in self.replicas]
        r = self.replicas[self.router.route(prompt_token_ids, loads, [r.alive for r in self.replicas])]
        self._send(r, ("add", request_id, prompt, list(prompt_token_ids), params, cache_salt))
        r.requests.add(request_id)
        self._where[request_id] = r

    def abort_request(self, request_id: str) -> bool:
        r = self._where.pop(request_id, None)
        if r is None:
            return False
        r.requests.discard(request_id)
        self._send(r, ("abort", [request_id]))
        return True

    def release(self, request_id: str) -> None:
        """A finished request's output was delivered (the replica released it when it sent it)."""
        self._where.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._pending) or any(r.requests for r in self.replicas if r.alive)

    def running_request_ids(self) -> list[str]:
        """The requests the last failed step (a replica failing) is blamed on."""
        ids, self._failed = self._failed, []
        return ids

    # ------------------------------------------------------------------ steps
    def step(self) -> list[RequestOutput]:
        """The outputs the replicas sent since the last call (waiting up to POLL_S for some). Raises
        ReplicaFailed for a replica that died or failed a step: only its requests are lost, and what the others
        sent is kept for the next call."""
        live = {r.conn: r for r in self.replicas if r.alive}
        for conn in wait(list(live), timeout=0 if self._pending else POLL_S):
            self._receive(live[conn])
        outs, self._pending = self._pending, []
        return outs

    def _receive(self, r: Replica) -> None:
        """Everything replica r has sent, into _pending (raises ReplicaFailed on its failure)."""
        while r.alive and r.conn.poll(0):
            try:
                msg = r.conn.recv()
            except (EOFError, OSError):
                self._lose(
                    r, f"data-parallel replica {r.index} exited with code {r.proc.poll()}", list(r.requests)
                )
            else:
                self._pending += self._take(r, msg)

    def _take(self, r: Replica, msg: tuple) -> list[RequestOutput]:
        if msg[0] == "out":
            _, outs, r.counters, r.stats = msg
            for o in outs:
                if o.finished:
                    r.requests.discard(o.request_id)
            return outs
        if msg[0] == "failed":
            self._fail(r, msg[2], msg[1])
        return []

    def _fail(self, r: Replica, message: str, ids: list[str]) -> None:
        for rid in ids:
            r.requests.discard(rid)
            self._where.pop(rid, None)
        self._failed = list(ids)
        raise ReplicaFailed(f"replica {r.index}: {message}", ids)

    def _lose(self, r: Replica, message: str, ids: list[str]) -> None:
        r.alive = False
        self._fail(r, message, ids)

    def _send(self, r: Replica, msg: tuple) -> None:
        try:
            r.conn.send(msg)
        except OSError:
            self._lose(r, f"data-parallel replica {r.index} is gone", list(r.requests))

    # ------------------------------------------------------------------ counts
    def stats(self) -> SchedulerStats:
        per = [r.stats for r in self.replicas if r.stats is not None and r.alive]
        slots = self.info.num_kv_slots * sum(r.alive for r in self.replicas)
        if not per:
            return SchedulerStats(0, 0, slots, slots, 0.0)
        return SchedulerStats(
            sum(s.running for s in per),
            sum(s.waiting for s in per),
            slots - sum(s.running for s in per),
            slots,
            sum(s.kv_cache_usage for s in per) / len(per),
        )

    @property
    def counters(self) -> EngineCounters:
        """The replicas' counters summed (means of the planner's figures and of the KV usage)."""
        return sum_counters([r.counters for r in self.replicas])

    @property
    def running(self) -> list[str]:
        """The requests the replicas hold (running or waiting there)."""
        return [rid for r in self.replicas if r.alive for rid in r.requests]

    @property
    def waiting(self) -> list[str]:
        return []

    def reset_prefix_cache(self) -> bool:
        """Every live replica forgets its cached prefixes (False if any still has requests holding blocks)."""
        ok = True
        for r in self.replicas:
            if not r.alive:
                continue
            self._send(r, ("reset",))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and r.conn.poll(deadline - time.monotonic()):
                msg = r.conn.recv()
                if msg[0] == "reset":
                    ok &= bool(msg[1])
                    break
                self._pending += self._take(r, msg)
        return ok

    def close(self) -> None:
        """Stop every replica (each ends its own tensor-parallel ranks) and wait for them."""
        for r in self.replicas:
            if r.alive:
                try:
                    r.conn.send(("stop",))
                except OSError:
                    pass
                r.alive = False
        for r in self.replicas:
            try:
                r.proc.wait(30)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
            r.conn.close()


def sum_counters(parts: list[EngineCounters]) -> EngineCounters:
    """Counters of several engines as one: ints and seconds summed, the planner's figures and KV usage averaged."""
    total = EngineCounters()
    averaged = ("mean_chosen_k", "verified_row_cost", "kv_cache_usage")
    for f in fields(EngineCounters):
        values = [getattr(c, f.name) for c in parts]
        if f.name == "spec":
            specs = [v for v in values if v is not None]
            if specs:
                total.spec = SpecDecodingStats(specs[0].num_spec_tokens)
                for v in specs:
                    total.spec.add(v)
        elif f.name in averaged:
            known = [v for v in values if v is not None]
            setattr(total, f.name, sum(known) / len(known) if known else getattr(total, f.name))
        else:
            setattr(total, f.name, sum(values))
    return total
