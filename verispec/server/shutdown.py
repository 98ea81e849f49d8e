"""uvicorn's server with a draining shutdown: the first SIGTERM / SIGINT refuses new requests and lets the running
ones finish (app.drain, up to --shutdown-timeout) before uvicorn's own shutdown; a second signal ends every request
at once (app.end_now: a stream gets an error event and [DONE]) and exits within END_GRACE_S seconds. It also keeps
the event loop's failed accepts (out of descriptors) to a throttled line (connections.quiet_accept_errors)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

import uvicorn

from verispec.server.app import drain, end_now
from verispec.server.connections import quiet_accept_errors

# how long the responses ended by a second signal may take to be sent before the process exits
END_GRACE_S = 2.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.ending = False
        self._tasks: set[asyncio.Task] = set()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(quiet_accept_errors)
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            super().handle_exit(sig, frame)
            return
        if not self.draining and not self.should_exit:
            self.draining = True
            # uvicorn raises the signal again once it has shut down, so the process still exits as the signal asks
            self._captured_signals.append(sig)
            loop.call_soon_threadsafe(self._start, self._drain())
        elif not self.ending:
            self.ending = True
            loop.call_soon_threadsafe(self._start, self._end_now(sig))

    def _start(self, coro) -> None:
        # the loop keeps only weak references to tasks
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        try:
            await drain(self.config.app, self.shutdown_timeout)
        finally:
            self.should_exit = True

    async def _end_now(self, sig: int) -> None:
        try:
            await end_now(self.config.app, END_GRACE_S)
        finally:
            # the signal's own action, now: no waiting for the engine thread's step or uvicorn's graceful close
            logging.shutdown()
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)
