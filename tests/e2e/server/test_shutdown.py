"""Draining shutdown (verispec/server/shutdown.py): SIGTERM refuses new requests, lets short ones finish and ends
the rest properly."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx

from tests.helpers import Server, wait_for
from tests.tiny_models import write_tiny_checkpoint


def test_sigterm_drains_then_ends_the_rest(tmp_path):
    """SIGTERM: new requests get 503 at once; a request that finishes within --shutdown-timeout completes; the
    rest end properly (a stream with an error event and [DONE], a plain request with OpenAI's error JSON); the
    process exits with no traceback in its log."""
    # a model wide and deep enough that its steps take milliseconds on any machine
    slow = write_tiny_checkpoint(
        tmp_path / "slow", "llama", num_layers=12, hidden_size=512, intermediate_size=2048
    )
    args = [str(slow), "--max-model-len", "512", "--max-num-seqs", "24", "--shutdown-timeout", "3"]
    args.append("--disable-uvicorn-access-log")
    srv = Server(args, tmp_path / "drain.log").wait_ready()
    url, results, lines = srv.url, {}, []
    # 8 sequences of 480 tokens with logprobs each: far more than the 1 s drain allows on any machine
    long_body = {
        "prompt": "count",
        "max_tokens": 480,
        "ignore_eos": True,
        "temperature": 0,
        "n": 8,
        "logprobs": 5,
    }

    def post(name: str, body: dict) -> None:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        results[name] = (r.status_code, r.json())

    def stream() -> None:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=long_body | {"stream": True}, timeout=120
        ) as r:
            lines.extend(x for x in r.iter_lines() if x)

    threads = [
        threading.Thread(target=stream),
        threading.Thread(target=post, args=("long", long_body)),
        threading.Thread(target=post, args=("short", long_body | {"max_tokens": 4, "n": 1})),
    ]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(lines) >= 2, 60, "the stream's first tokens")
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, 10, "draining /health")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        # a request already admitted before the signal still runs
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
        for t in threads:
            t.join(60)
        srv.proc.wait(30)
        took = time.monotonic() - t0
    finally:
        srv.stop()
    status, body = results["short"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    status, body = results["long"]
    assert status == 503 and body["error"]["code"] == 503 and "shut down" in body["error"]["message"], body
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: ") :])
    assert last["error"]["code"] == 503, lines[-3:]
    # the long requests ran into the 3 s timeout; everything ended soon after it
    assert 2.5 < took < 20, took
    log = (tmp_path / "drain.log").read_text()
    assert "Traceback" not in log and re.search(r"ending \d+ requests", log), log[-3000:]


def test_a_second_sigterm_exits_at_once(tmp_path):
    """A second SIGTERM while draining exits within seconds, however long --shutdown-timeout is; the stream still
    running ends with an error event and [DONE], and the log has no traceback."""
    slow = write_tiny_checkpoint(
        tmp_path / "slow", "llama", num_layers=12, hidden_size=512, intermediate_size=2048
    )
    args = [str(slow), "--max-model-len", "512", "--shutdown-timeout", "120", "--disable-uvicorn-access-log"]
    srv = Server(args, tmp_path / "twice.log").wait_ready()
    # 8 sequences of 480 tokens with logprobs: far longer than the test may wait on any machine
    body = {"prompt": "count", "max_tokens": 480, "ignore_eos": True, "temperature": 0, "n": 8, "logprobs": 5}
    body["stream"] = True
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
            lines.extend(x for x in r.iter_lines() if x)

    t = threading.Thread(target=stream)
    try:
        t.start()
        wait_for(lambda: len(lines) >= 2, 60, "the stream's first tokens")
        srv.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 503, 10, "draining /health")
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(30)
        took = time.monotonic() - t0
        t.join(10)
    finally:
        srv.stop()
    assert took < 5, took
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2][len("data: ") :])["error"]["code"] == 503, lines[-3:]
    log = (tmp_path / "twice.log").read_text()
    assert "Traceback" not in log, log[-3000:]
