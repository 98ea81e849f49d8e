"""Async front end over the single-threaded LLMEngine.

One dedicated engine thread owns the engine: it drains an inbox of add/abort commands between steps, steps the
engine, and pushes outputs to per-HTTP-request asyncio queues with `loop.call_soon_threadsafe`. Nothing else
touches the engine. A failing request (bad input, or a step that raises) is failed on its own; the thread keeps
serving.

The engine thread is also where the server loads the model (`on_engine_thread`): every kernel call then starts its
parallel regions from one OS thread. libgomp keeps a worker pool per thread that starts parallel regions; with a
second pool (model loaded on the main thread, steps on another) it counts more threads than CPUs on a small
machine and lets its workers sleep between regions (benchmarks/serve_load.py measures the difference).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass

from verispec.engine.fanout import EngineRequest
from verispec.llm import LLM
from verispec.outputs import RequestOutput
from verispec.server.metrics import ServerMetrics

logger = logging.getLogger("verispec.server")


class _EngineThread:
    """One long-lived daemon thread that runs the callables handed to it, in order."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="verispec-engine", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, fut = self._calls.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            # handed to whoever waits on the future
            except BaseException as e:
                fut.set_exception(e)

    def submit(self, fn: Callable[[], object]) -> Future:
        fut: Future = Future()
        self._calls.put((fn, fut))
        return fut


_ENGINE_THREAD: _EngineThread | None = None
_ENGINE_THREAD_LOCK = threading.Lock()


def on_engine_thread(fn: Callable[[], object]) -> Future:
    """Run `fn` on the server's engine thread (created on first use); the model is loaded there too."""
    global _ENGINE_THREAD
    with _ENGINE_THREAD_LOCK:
        if _ENGINE_THREAD is None:
            _ENGINE_THREAD = _EngineThread()
    return _ENGINE_THREAD.submit(fn)


class QueueFullError(Exception):
    """More requests are waiting than --max-queue allows (HTTP 503)."""


class EngineError(Exception):
    """The engine failed this request or is shutting down (HTTP 500)."""

    status = 500


class ServerShuttingDown(EngineError):
    """The server is shutting down: no new requests, and the ones left at the end are ended (HTTP 503)."""

    status = 503


class RequestAborted(Exception):
    """The request was aborted (its client went away)."""


class RequestGroup:
    """The engine requests of one HTTP request (prompts x n); outputs arrive on one queue as (index, output)."""

    def __init__(self, request_ids: list[str], loop: asyncio.AbstractEventLoop):
        self.request_ids = request_ids
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, RequestOutput | BaseException]] = asyncio.Queue()
        self.arrival = time.monotonic()

    # called from the engine thread
    def push(self, rid: str, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (rid, item))
        # event loop already closed (shutdown)
        except RuntimeError:
            pass

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        left = set(self.request_ids)
        while left:
            rid, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                left.discard(rid)
            yield self.index[rid], item


@dataclass
class _Track:
    """Engine-thread bookkeeping for one engine request."""

    group: RequestGroup
    num_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None


class AsyncEngine:
    def __init__(self, llm: LLM, metrics: ServerMetrics | None = None, max_queue: int = 256):
        self.llm, self.engine, self.metrics = llm, llm.engine, metrics
        self.max_queue = max_queue
        self.num_slots = self.engine.stats().num_kv_slots
        self._inbox: deque[tuple] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # engine thread only
        self._tracks: dict[str, _Track] = {}
        # engine requests submitted and not yet finished (guarded by _lock)
        self._num_inflight = 0
        self._stopping = False
        # set under _lock once the thread will read no more commands
        self._closed = False
        self._loop_done: Future | None = None
        # event-loop side: the groups whose responses may still be running (end_all ends them without the thread)
        self._groups: weakref.WeakSet[RequestGroup] = weakref.WeakSet()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._loop_done = on_engine_thread(self._run)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._loop_done is not None:
            try:
                self._loop_done.result(timeout)
            except FutureTimeout:
                logger.warning("the engine loop did not stop within %.0f s", timeout)
                return
        # the loop has stopped: no step runs while the engine's other processes are told to stop
        self.engine.close()

    def end_all(self, message: str) -> int:
        """From the event loop, at once (a second shutdown signal): every request's response gets
        ServerShuttingDown(message) now, without waiting for the engine thread to finish its step, and the thread
        stops. Returns how many HTTP requests were ended."""
        self._stopping = True
        self._wake.set()
        groups = list(self._groups)
        for group in groups:
            for rid in group.request_ids:
                # a group already finished ignores it
                group.queue.put_nowait((rid, ServerShuttingDown(message)))
        return len(groups)

    @property
    def alive(self) -> bool:
        return self._loop_done is not None and not self._loop_done.done() and not self._stopping

    @property
    def num_inflight(self) -> int:
        """Engine requests submitted and not finished yet (running or waiting)."""
        with self._lock:
            return self._num_inflight

    @property
    def num_waiting(self) -> int:
        """Requests submitted beyond the KV slots (queued in the inbox or the engine's waiting list)."""
        with self._lock:
            return max(0, self._num_inflight - self.num_slots)

    def stats(self) -> dict:
        """The engine's request and KV-slot counts (for /health)."""
        return asdict(self.engine.stats())

    # ------------------------------------------------------------------ front-end API (event-loop thread)
    async def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        """Add the requests atomically. Raises QueueFullError, ValueError (invalid input) or EngineError."""
        loop = asyncio.get_running_loop()
        group = RequestGroup([r.request_id for r in requests], loop)
        ack: asyncio.Future = loop.create_future()
        with self._lock:
            if self._closed or self._stopping:
                raise ServerShuttingDown("The server is shutting down and accepts no new requests.")
            waiting = max(0, self._num_inflight - self.num_slots)
            if self._num_inflight + len(requests) - self.num_slots > self.max_queue:
                raise QueueFullError(
                    f"Server overloaded: {waiting} requests are waiting and the queue limit is {self.max_queue} "
                    "(--max-queue). Retry later."
                )
            self._num_inflight += len(requests)
            self._inbox.append(("add", requests, group, ack))
        self._wake.set()
        try:
            await ack
        except asyncio.CancelledError:
            self.abort(group.request_ids)
            raise
        self._groups.add(group)
        return group

    def abort(self, request_ids: list[str]) -> None:
        """Abort (no-op for finished ones). Frees KV slots as soon as the engine thread sees the command."""
        self._send(("abort", list(request_ids)))

    def _send(self, cmd: tuple) -> None:
        with self._lock:
            self._inbox.append(cmd)
        self._wake.set()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._sync_metrics()
                    if self.engine.spec_log is not None:
                        self.engine.spec_log.maybe_log()
                    self._wake.wait(1.0)
        # a bug in the loop itself: fail everyone, never hang clients
        except BaseException:
            logger.exception("engine loop crashed")
        finally:
            self._stopping = True
            with self._lock:
                # submit() refuses from now on; drain what already arrived
                self._closed = True
            self._drain_inbox()
            for rid in list(self._tracks):
                self._fail(rid, ServerShuttingDown("The server shut down before this request finished."))

    def _drain_inbox(self) -> None:
        self._wake.clear()
        with self._lock:
            cmds = list(self._inbox)
            self._inbox.clear()
        for cmd in cmds:
            if cmd[0] == "add":
                self._add(*cmd[1:])
            else:
                for rid in cmd[1]:
                    self._abort(rid)
        if cmds:
            self._sync_metrics()

    def _add(self, requests: list[EngineRequest], group: RequestGroup, ack: asyncio.Future) -> None:
        added: list[str] = []
        error: BaseException | None = None
        if self._stopping:
            error = ServerShuttingDown("The server is shutting down and accepts no new requests.")
        for r in requests if error is None else ():
            try:
                self.engine.add_request(
                    r.request_id,
                    r.prompt,
                    r.prompt_token_ids,
                    r.params,
                    r.bad_words_token_ids,
                    r.cache_salt,
                    grammar=r.grammar,
                )
            # ValueError: invalid input -> 400; anything else -> 500
            except Exception as e:
                error = e if isinstance(e, ValueError) else EngineError(f"failed to add request: {e!r}")
                break
            self._tracks[r.request_id] = _Track(group)
            added.append(r.request_id)
        if error is not None:
            for rid in added:
                self._tracks.pop(rid, None)
                self.engine.abort_request(rid)
                self.engine.release(rid)
            self._done(len(requests))
        group.loop.call_soon_threadsafe(_resolve, ack, error)

    def _abort(self, rid: str) -> None:
        track = self._tracks.pop(rid, None)
        if track is None:
            return
        self.engine.abort_request(rid)
        self.engine.release(rid)
        self._done(1)
        if self.metrics is not None:
            # vLLM counts it as request_success{finished_reason="abort"}
            self.metrics.request_finished("abort")
        track.group.push(rid, RequestAborted(f"request {rid} was aborted"))

    def _fail(self, rid: str, error: BaseException) -> None:
        track = self._tracks.pop(rid, None)
        try:
            self.engine.abort_request(rid)
            self.engine.release(rid)
        except Exception:
            logger.exception("could not abort request %s", rid)
        if track is not None:
            self._done(1)
            track.group.push(rid, error)

    def _done(self, n: int) -> None:
        with self._lock:
            self._num_inflight -= n

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # We cannot tell which request broke the step: fail the batch that ran, keep the waiting ones.
            running = self.engine.running_request_ids()
            logger.exception("engine step failed; failing the %d running requests", len(running))
            for rid in running:
                self._fail(rid, EngineError(f"engine step failed: {e!r}"))
            self._sync_metrics()
            return
        # before delivery: a client that sees its last token also sees it counted
        self._sync_metrics()
        now = time.monotonic()
        for out in outputs:
            self._deliver(out, now)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        rid = out.request_id
        track = self._tracks.get(rid)
        # aborted meanwhile
        if track is None:
            if out.finished:
                self.engine.release(rid)
            return
        comp = out.outputs[0]
        m = self.metrics
        if len(comp.token_ids) > track.num_tokens:
            if m is not None:
                if track.first_token is None:
                    m.observe_ttft(now - track.group.arrival)
                else:
                    m.observe_itl(now - track.last_token)
            track.first_token = track.first_token or now
            track.last_token = now
            track.num_tokens = len(comp.token_ids)
        if out.finished:
            del self._tracks[rid]
            self.engine.release(rid)
            self._done(1)
            if m is not None:
                m.request_finished(comp.finish_reason)
                m.observe_e2e(now - track.group.arrival)
        track.group.push(rid, out)

    def _sync_metrics(self) -> None:
        if self.metrics is None:
            return
        stats = self.engine.stats()
        self.metrics.sync_counters(self.engine.counters)
        self.metrics.update_gauges(stats.running, stats.waiting, stats.free_kv_slots, stats.kv_cache_usage)


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
