"""Connections, below HTTP: uvicorn's h11 protocol with the limits it lacks against slow and idle clients.

- `--read-timeout`: a request's line and headers must arrive within this many seconds of the connection opening (or
  of the first byte of the next request on a kept-alive connection), and its body must keep arriving (no gap as
  long); otherwise the connection is closed. A half-sent request holds a descriptor until then.
- `--keep-alive-timeout`: an idle kept-alive connection is closed (uvicorn's own `timeout_keep_alive`).
- `--max-connections`: at most this many open connections. One more closes the connection idle the longest (no
  request in progress: half-sent headers, or kept alive between requests), so that /health and real clients still
  get in under a flood; when every connection is serving a request, the new one gets a 503 and is closed. The
  process's descriptor limit (raised to its hard limit first) leaves room for them all, or the limit is lowered.
- Refused and dropped connections and failed accepts are logged at most once per LOG_EVERY_S seconds per kind, with
  a count, never a traceback per connection.

uvicorn's h11 limits stay as they are: a request line and headers of at most 16 KiB, then 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import resource
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from verispec.server import protocol as P

logger = logging.getLogger("verispec.server")

# descriptors kept for everything but client connections: the listening socket, the event loop, logs, pipes, files
FD_RESERVE = 64
# the listen backlog: uvicorn's default, and at least this many when descriptors are scarce
MAX_BACKLOG = 2048
MIN_BACKLOG = 16
LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    read_timeout: float = 10.0
    max_connections: int = 512
    # the listen backlog, which is also how many connections asyncio accepts at once before any is closed
    backlog: int = MAX_BACKLOG


class ThrottledLog:
    """At most one line per kind every `every` seconds, counting the ones left out."""

    def __init__(self, every: float = LOG_EVERY_S):
        self.every = every
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def log(self, level: int, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -math.inf) < self.every:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        self._last[kind] = now
        skipped = self._skipped.pop(kind, 0)
        more = f" ({skipped} more since the last such line)" if skipped else ""
        logger.log(level, "%s%s", message, more)


_LOG = ThrottledLog()


def _busy_response() -> bytes:
    body = json.dumps(
        P.error_body(503, "Too many open connections (--max-connections), all serving requests. Retry later.")
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _raise_soft_limit(want: int) -> float:
    """Raise the soft descriptor limit toward `want` (up to the hard limit); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return math.inf
    if soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def fit_limits(read_timeout: float, max_connections: int) -> ConnectionLimits:
    """Limits whose descriptors fit the process's limit: every connection, two bursts of accepts (asyncio accepts
    up to `backlog` connections before the ones over the limit are closed) and FD_RESERVE others. The soft limit is
    raised toward the hard one first; if it still falls short, a smaller backlog, then fewer connections (with a
    warning)."""
    soft = _raise_soft_limit(max_connections + 2 * MAX_BACKLOG + FD_RESERVE)
    room = soft - FD_RESERVE
    if room >= max_connections + 2 * MIN_BACKLOG:
        backlog = int(min(MAX_BACKLOG, (room - max_connections) // 2))
        return ConnectionLimits(read_timeout, max_connections, backlog)
    fit = int(max(1, room - 2 * MIN_BACKLOG))
    logger.warning(
        "--max-connections lowered from %d to %d: this process may open %d descriptors (ulimit -n)",
        max_connections,
        fit,
        soft,
    )
    return ConnectionLimits(read_timeout, fit, MIN_BACKLOG)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class to hand uvicorn (Config(http=...)): one instance per connection."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


class GuardedH11Protocol(H11Protocol):
    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        # since when no request is in progress (the oldest idle connection makes room first)
        self.idle_since = time.monotonic()
        self._refused = False

    @property
    def idle(self) -> bool:
        """No request in progress: its headers are not all in yet, or the connection is kept alive between
        requests. Closing it loses no work."""
        waiting = self.cycle is None or self.cycle.response_complete
        return waiting and self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections and not self._make_room():
            self._refused = True
            transport.write(_busy_response())
            transport.close()
            _LOG.log(
                logging.WARNING, "refused", "refusing connections: --max-connections are all serving requests"
            )
            return
        super().connection_made(transport)
        self._arm_read_timer()

    def _make_room(self) -> bool:
        """Close the connection idle the longest; False if every connection is serving a request."""
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        if len(open_) < self.limits.max_connections:
            return True
        idle = [c for c in open_ if isinstance(c, GuardedH11Protocol) and c.idle]
        if not idle:
            return False
        min(idle, key=lambda c: c.idle_since).transport.close()
        _LOG.log(
            logging.WARNING,
            "evicted",
            f"{self.limits.max_connections} connections open (--max-connections): closing the ones idle longest "
            "to let new ones in",
        )
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            # the body must keep arriving
            self._arm_read_timer()
        elif state is h11.IDLE:
            # headers under way: the deadline runs from their first byte (or from the connection opening)
            if self._read_timer is None:
                self._arm_read_timer()
        else:
            self._cancel_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.idle_since = time.monotonic()
        if self.conn.their_state is h11.SEND_BODY:
            self._arm_read_timer()
        else:
            # until the next request starts, the keep-alive timeout applies
            self._cancel_read_timer()

    def _arm_read_timer(self) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(self.limits.read_timeout, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY and self.flow.read_paused:
            # the app is not reading the body yet: not the client's delay
            self._arm_read_timer()
            return
        if state in (h11.IDLE, h11.SEND_BODY):
            _LOG.log(
                logging.INFO, "timeout", "closing connections whose request did not arrive in --read-timeout"
            )
            self.transport.close()


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's exception handler: a failed accept (out of descriptors, retried by asyncio every second) is
    one throttled line without a traceback; anything else goes to asyncio's default handler."""
    exc = context.get("exception")
    where = f"{context.get('message', '')} {context.get('handle', '')}"
    if isinstance(exc, (OSError, ValueError)) and ("accept" in where or "_start_serving" in where):
        _LOG.log(logging.WARNING, "accept", f"cannot accept connections: {exc}")
        return
    loop.default_exception_handler(context)
