"""One data-parallel replica: a process holding a whole engine, driven over a socket by the front end
(engine/data_parallel.py). It adds and aborts what it is told, steps while it has work, and sends each step's
outputs with its counters (finished requests are released once sent); a failed step is reported with the requests it ran, and the replica goes on.

Messages are pickled tuples on a private socket pair between the front end and the processes it started (weights
never cross it): ("add", request_id, prompt, prompt_token_ids, params, cache_salt), ("abort", ids), ("reset",),
("stop",) in; ("ready", info), ("out", outputs, counters, stats), ("failed", ids, message),
("reset", ok) out.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

from verispec.distributed.cpus import bind_process
from verispec.engine.args import EngineArgs
from verispec.engine.builder import build_engine
from verispec.engine.engine import LLMEngine

logger = logging.getLogger("verispec.replica")


@dataclass
class ReplicaInfo:
    """What the front end needs from a replica's engine to validate and serve requests without weights."""

    tokenizer: object
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_slots: int
    speculative_config: object
    spec_metrics: str
    block_size: int


def info_of(engine: LLMEngine) -> ReplicaInfo:
    return ReplicaInfo(
        engine.tokenizer,
        engine.opts.max_model_len,
        engine.runner.model.cfg.vocab_size,
        tuple(engine.eos_token_ids),
        engine.stats().num_kv_slots,
        engine.speculative_config,
        engine.opts.spec_metrics,
        engine.cache.block_size,
    )


def serve(engine: LLMEngine, conn: Connection) -> None:
    """The replica's loop, until ("stop",) or the front end goes away."""
    while True:
        # block while idle; between steps, only take what has arrived
        timeout = 0 if engine.has_unfinished() else None
        while conn.poll(timeout):
            if not handle(engine, conn, conn.recv()):
                return
            timeout = 0
        if engine.has_unfinished():
            try:
                outputs = engine.step()
            except Exception as e:
                ids = engine.running_request_ids()
                logger.exception("replica step failed; failing its %d running requests", len(ids))
                for rid in ids:
                    engine.abort_request(rid)
                    engine.release(rid)
                conn.send(("failed", ids, f"engine step failed: {e!r}"))
                continue
            conn.send(("out", outputs, engine.counters, engine.stats()))
            # delivered: the front end never asks for a finished request again
            for out in outputs:
                if out.finished:
                    engine.release(out.request_id)


def handle(engine: LLMEngine, conn: Connection, msg: tuple) -> bool:
    """One command from the front end; False for stop."""
    kind = msg[0]
    if kind == "add":
        _, rid, prompt, ids, params, salt = msg
        try:
            engine.add_request(rid, prompt, ids, params, cache_salt=salt)
        except Exception as e:
            conn.send(("failed", [rid], f"failed to add request: {e!r}"))
    elif kind == "abort":
        for rid in msg[1]:
            engine.abort_request(rid)
            engine.release(rid)
    elif kind == "reset":
        conn.send(("reset", engine.reset_prefix_cache()))
    return kind != "stop"


def main(argv: list[str] | None = None) -> None:
    """The replica process: argv = [EngineArgs as JSON, the socket's file descriptor, the cores to run on (comma
    separated; empty: no binding)]."""
    # Ctrl-C reaches the whole process group: the front end decides when replicas stop ("stop", or its exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 2 and argv[2]:
        # before the load: the weights are first touched by these cores' node
        bind_process([int(c) for c in argv[2].split(",")])
    conn = Connection(socket.socket(fileno=int(argv[1])).detach())
    try:
        engine = build_engine(EngineArgs(**json.loads(argv[0])))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", info_of(engine)))
    try:
        serve(engine, conn)
    except (EOFError, OSError):
        # the front end is gone
        pass
    finally:
        engine.close()


def replica_args(args: EngineArgs, threads: int, device: str) -> str:
    """The JSON EngineArgs of one replica: the front end's, one replica, its device and share of the threads."""
    fields = asdict(args) | {"data_parallel_size": 1, "threads": threads, "device": device}
    return json.dumps(fields)
