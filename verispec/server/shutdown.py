"""uvicorn's server with a draining shutdown: the first SIGTERM / SIGINT refuses new requests and lets the running
ones finish (app.drain, up to --shutdown-timeout) before uvicorn's own shutdown; a second signal exits at once."""

from __future__ import annotations

import asyncio

import uvicorn

from verispec.server.app import drain


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        # uvicorn raises the signal again once it has shut down, so the process still exits as the signal asks
        self._captured_signals.append(sig)
        loop.call_soon_threadsafe(self._start_drain, loop)

    def _start_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        self._drain_task = loop.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await drain(self.config.app, self.shutdown_timeout)
        finally:
            self.should_exit = True
