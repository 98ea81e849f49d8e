"""Connections (verispec/server/connections.py): half-sent requests and idle connections are closed
(--read-timeout, --keep-alive-timeout), a flood of them can neither use up the descriptors nor keep /health out
(--max-connections, fitted to the descriptor limit), and none of it floods the log."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time

import httpx

from tests.helpers import Server, wait_for
from verispec.server import connections

HALF_SENT = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-"


def connect(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(data)
    return s


def closed_by_server(s: socket.socket, within: float) -> bool:
    """Whether the server closes the connection within `within` seconds (whatever it says first)."""
    s.settimeout(within)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        s.close()


def health_answers(url: str) -> bool:
    """/health answers 200 within seconds (room for one dropped SYN under a flood; before, it never answered)."""
    t = time.monotonic()
    return httpx.get(f"{url}/health", timeout=5).status_code == 200 and time.monotonic() - t < 4


def test_slow_and_idle_clients_cannot_hold_the_server(tmp_path, ckpt):
    """256 descriptors (ulimit -n) and 400 half-sent requests: /health still answers at once, every half-sent
    request is closed after --read-timeout, so is a body that stops arriving and an idle kept-alive connection
    (--keep-alive-timeout); the descriptors never run out, and the log holds a few lines, no traceback."""
    args = [ckpt, "--max-model-len", "64", "--read-timeout", "3", "--keep-alive-timeout", "1"]
    log = tmp_path / "flood.log"
    srv = Server([*args, "--disable-uvicorn-access-log"], log, nofile=256).wait_ready()
    try:
        flood = [connect(srv.port, HALF_SENT) for _ in range(400)]
        assert all(health_answers(srv.url) for _ in range(5))
        assert sum(closed_by_server(s, 15) for s in flood) == len(flood)
        stalled = connect(
            srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        )
        assert closed_by_server(stalled, 10)
        idle = connect(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(65536).startswith(b"HTTP/1.1 200")
        assert closed_by_server(idle, 10)
    finally:
        srv.stop()
    text = log.read_text()
    assert "Traceback" not in text and "--max-connections lowered" in text, text[-3000:]
    assert "Too many open files" not in text and len(text) < 50_000, text[-3000:]
    assert text.count("--read-timeout") < 8, text[-3000:]


def test_connections_over_the_limit(tmp_path, ckpt):
    """--max-connections 4: a fifth connection closes the one idle longest; when all four serve requests (headers
    in, body under way), the fifth gets a 503 in OpenAI's error JSON."""
    args = [ckpt, "--max-model-len", "64", "--max-connections", "4", "--disable-uvicorn-access-log"]
    srv = Server(args, tmp_path / "limit.log").wait_ready()
    try:
        idle = [connect(srv.port, HALF_SENT) for _ in range(4)]
        time.sleep(0.5)
        assert health_answers(srv.url)
        assert closed_by_server(idle[0], 5)
        for s in idle[1:]:
            s.close()
        started = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{"
        busy = []
        for _ in range(4):
            busy.append(connect(srv.port, started))
            # until the server has read its headers, a connection looks like a half-sent request
            time.sleep(0.3)
        refused = connect(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        refused.settimeout(10)
        answer = refused.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections" in answer, answer
        for s in busy:
            s.close()
        wait_for(lambda: health_answers(srv.url), 10, "/health once the busy connections are gone")
    finally:
        srv.stop()
    assert "Traceback" not in (tmp_path / "limit.log").read_text()


def test_failed_accepts_are_one_line_without_traceback(caplog, monkeypatch):
    """asyncio reports each failed accept (out of descriptors) with a traceback; the server's loop handler makes
    them one throttled line."""
    monkeypatch.setattr(connections, "_LOG", connections.ThrottledLog())
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(1000):
                exc = OSError(errno.EMFILE, "Too many open files")
                connections.quiet_accept_errors(
                    loop, {"message": "socket.accept() out of system resource", "exception": exc}
                )
    finally:
        loop.close()
    lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None and "Too many open files" in lines[0].getMessage()
