"""Hostile-client probe of `verispec serve`: starts the real server as a subprocess and checks how it answers bad
types, huge lists, slow clients, missing keys, big bodies, disconnects, SIGTERM and concurrency. Each check prints
one PASS/FAIL line; the exit status is 1 if any failed.

    .venv/bin/python scripts/probe_server.py
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
VERISPEC = str(ROOT / ".venv" / "bin" / "verispec")
MODEL = "smollm2-135m-instruct"
KEY = "probe-key-0123456789"
FAILED: list[str] = []
CMPL = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def check(name: str, ok: bool, reason: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {reason}", flush=True)
    if not ok:
        FAILED.append(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, *extra: str) -> tuple[subprocess.Popen, Path]:
    log = Path(tempfile.mkstemp(prefix="probe_server_", suffix=".log")[1])
    cmd = [VERISPEC, "serve", MODEL, "--port", str(port), "--api-key", KEY, "--max-model-len", "512", *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if request(port, "GET", "/health", timeout=2)[0] == 200:
                return proc, log
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    sys.exit(f"server did not become healthy:\n{log.read_text()}")


def request(port, method, path, body=None, key=KEY, timeout=60.0, headers=None) -> tuple[int, bytes]:
    """One raw HTTP request; body: dict (sent as JSON), str or bytes (sent as they are)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    try:
        conn.request(method, path, body=body, headers=h)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def error_shape(status: int, data: bytes, want: tuple[int, ...]) -> tuple[bool, str, dict]:
    """Whether the answer has a wanted status and OpenAI's error JSON; a short reason; the error object."""
    try:
        err = json.loads(data)["error"]
        shaped = all(k in err for k in ("message", "type", "param", "code")) and isinstance(
            err["message"], str
        )
    except (ValueError, KeyError, TypeError):
        err, shaped = {}, False
    msg = str(err.get("message", data[:120]))[:110]
    ok = status in want and shaped
    return (
        ok,
        f"{status} param={err.get('param')!r} {msg!r}" + ("" if shaped else " (not OpenAI error JSON)"),
        err,
    )


def expect_error(port, name, path, body, want=(400,), key=KEY, param=None) -> None:
    status, data = request(port, "POST", path, body, key=key)
    ok, reason, err = error_shape(status, data, want)
    if ok and param is not None and param not in (str(err.get("param")), err.get("message", "")):
        ok, reason = False, f"{reason} (does not name {param})"
    check(name, ok, reason)


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)


def check_start_refusals() -> None:
    cases = [("--api-key ''", ["--api-key", ""], {}), ("VERISPEC_API_KEY=''", [], {"VERISPEC_API_KEY": ""})]
    for name, args, env in cases:
        cmd = [VERISPEC, "serve", MODEL, "--port", str(free_port()), *args]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env={**os.environ, **env})
            out = (r.stderr + r.stdout).strip()
            ok = r.returncode == 2 and "Traceback" not in out
            check(
                f"5 {name} refused", ok, f"exit {r.returncode}: {out.splitlines()[-1][:100] if out else ''}"
            )
        except subprocess.TimeoutExpired:
            check(f"5 {name} refused", False, "still running after 90 s (it started without a key?)")


def check_binding(port: int) -> None:
    ss = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout
    addrs = [line.split()[3] for line in ss.splitlines()[1:] if line.split()[3].endswith(f":{port}")]
    ips = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    ip = next((a for a in ips if "." in a and not a.startswith("127.")), None)
    refused = "no non-loopback IPv4"
    if ip:
        try:
            socket.create_connection((ip, port), timeout=2).close()
            refused = f"{ip}:{port} ACCEPTED a connection"
        except OSError as e:
            refused = f"{ip}:{port} {type(e).__name__}"
    check(
        "11 binds 127.0.0.1 only",
        addrs == [f"127.0.0.1:{port}"] and "ACCEPTED" not in refused,
        f"listening on {addrs}; {refused}",
    )


def check_auth(port: int) -> None:
    for name, path, body, key in [
        ("6 malformed JSON, no key -> 401", "/v1/completions", '{"model": ', None),
        ("6 malformed JSON, wrong key -> 401", "/v1/completions", '{"model": ', "wrong"),
        ("6 unknown route /v1/nope, no key -> 401", "/v1/nope", "{}", None),
    ]:
        expect_error(port, name, path, body, want=(401,), key=key)
    for path in ("/docs", "/redoc", "/openapi.json"):
        status, data = request(port, "GET", path, key=None)
        check(f"6 {path} not served without key", status in (401, 404), f"{status} {data[:60]!r}")


def check_types(port: int) -> None:
    cases = [
        (f"completions {k}={v!r}", "/v1/completions", {**CMPL, k: v}, k)
        for k, v in [
            ("max_tokens", "4"),
            ("max_tokens", True),
            ("temperature", "0.5"),
            ("top_p", "0.9"),
            ("n", "2"),
            ("n", True),
            ("seed", "5"),
            ("stream", "yes"),
            ("echo", 1),
        ]
    ]
    cases += [
        ("chat logprobs='yes'", "/v1/chat/completions", {**CHAT, "logprobs": "yes"}, "logprobs"),
        (
            "chat top_logprobs='3'",
            "/v1/chat/completions",
            {**CHAT, "logprobs": True, "top_logprobs": "3"},
            "top_logprobs",
        ),
    ]
    for name, path, body, field in cases:
        expect_error(port, f"1 {name} -> 400", path, body, param=field)
    raw = '{"model": "%s", "prompt": "hi", "max_tokens": 4, %s}'
    expect_error(
        port,
        "2 logit_bias NaN -> 400",
        "/v1/completions",
        raw % (MODEL, '"logit_bias": {"100": NaN}'),
        param="logit_bias",
    )
    expect_error(
        port,
        "2 temperature Infinity -> 400",
        "/v1/completions",
        raw % (MODEL, '"temperature": Infinity'),
        param="temperature",
    )


def check_list_limits(port: int) -> None:
    big = [
        ("bad_words 100k", {**CMPL, "bad_words": [f"w{i}" for i in range(100_000)]}),
        ("stop 280k", {**CMPL, "stop": [f"s{i}" for i in range(280_000)]}),
    ]

    def normal():
        t0 = time.monotonic()
        status, _ = request(port, "POST", "/v1/completions", {**CMPL, "max_tokens": 16})
        return status, time.monotonic() - t0

    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(request, port, "POST", "/v1/completions", body) for _, body in big]
        time.sleep(0.05)
        status, took = pool.submit(normal).result()
        for (name, _), fut in zip(big, futs):
            ok, reason, _ = error_shape(*fut.result(), (400,))
            check(f"3 {name} -> 400", ok, reason)
    check("3 concurrent 16-token request < 5 s", status == 200 and took < 5, f"{status} in {took:.2f} s")


def check_bodies(port: int) -> None:
    expect_error(
        port,
        "7 stop_token_ids [99999999] -> 400",
        "/v1/completions",
        {**CMPL, "stop_token_ids": [99999999]},
        param="stop_token_ids",
    )
    expect_error(
        port,
        "7 lone surrogate in unknown field -> 400",
        "/v1/completions",
        '{"model": "' + MODEL + '", "prompt": "hi", "x": "\\ud800"}',
    )
    for mode in ("content-length", "chunked"):
        check_big_body(port, mode)
    expect_error(port, "8 malformed JSON -> 400", "/v1/completions", '{"model": "x", "prompt": ')
    expect_error(port, "8 JSON array body -> 400", "/v1/completions", "[1, 2]")
    for name, path, body in [
        ("empty prompt ''", "/v1/completions", {**CMPL, "prompt": ""}),
        ("empty prompt []", "/v1/completions", {**CMPL, "prompt": []}),
        ("empty messages", "/v1/chat/completions", {**CHAT, "messages": []}),
        ("max_tokens 0", "/v1/completions", {**CMPL, "max_tokens": 0}),
        ("max_tokens -1", "/v1/completions", {**CMPL, "max_tokens": -1}),
        ("chat max_tokens 0", "/v1/chat/completions", {**CHAT, "max_tokens": 0}),
        ("n 0", "/v1/completions", {**CMPL, "n": 0}),
    ]:
        expect_error(port, f"8 {name} -> 400", path, body)
    for path, body in [("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)]:
        status, data = request(port, "POST", path, {**body, "model": "gpt-nope"})
        ok, reason, err = error_shape(status, data, (404,))
        check(f"8 unknown model {path} -> 404", ok and "does not exist" in err["message"], reason)
    try:
        client(port).completions.create(model="gpt-nope", prompt="hi", max_tokens=2)
        check("8 openai client: unknown model -> NotFoundError", False, "no exception")
    except openai.APIStatusError as e:
        check(
            "8 openai client: unknown model -> NotFoundError",
            isinstance(e, openai.NotFoundError),
            type(e).__name__,
        )


def check_big_body(port: int, mode: str) -> None:
    size = 20 << 20
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    head += "Content-Type: application/json\r\n"
    head += (
        f"Content-Length: {size}\r\n\r\n"
        if mode == "content-length"
        else "Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b'{"prompt": "' + b"a" * (256 << 10)
    if mode == "chunked":
        chunk = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(head.encode())
        try:
            for _ in range(size // len(chunk)):
                s.sendall(chunk)
        except OSError:
            pass  # the server stopped reading or closed: fine, its answer should be waiting
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                part = s.recv(65536)
                if not part:
                    break
                data += part
        except OSError as e:
            data += f" <{type(e).__name__}>".encode()
    took = time.monotonic() - t0
    line = data.split(b"\r\n", 1)[0].decode(errors="replace")
    ok = took < 1.0 and (" 413 " in line or " 400 " in line)
    check(f"8 20 MB body ({mode}) refused < 1 s", ok, f"{line or data[:60]!r} after {took:.2f} s")


def read_stream(port: int, body: dict, events: list[str], started: threading.Event | None = None) -> None:
    """POST a streamed request and append each SSE data line to `events` ('<cut: ...>' if the stream breaks)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            events.append(f"<status {resp.status}: {resp.read()[:100]!r}>")
            return
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:"):
                events.append(line[5:].strip())
                if started is not None:
                    started.set()
    except (OSError, http.client.HTTPException) as e:
        events.append(f"<cut: {type(e).__name__}>")
    finally:
        conn.close()
        if started is not None:
            started.set()


def stream_end(events: list[str]) -> tuple[str, str]:
    """('done', ...) for a normal end, ('error-done', ...) for an error event then [DONE], else ('bad', ...)."""
    if not events or events[-1] != "[DONE]":
        return "bad", f"last event {events[-1] if events else None!r} ({len(events)} events)"
    errors = [e for e in events[:-1] if e.startswith("<") or "error" in json.loads(e)]
    if not errors:
        return "done", f"{len(events)} events, ends with [DONE]"
    if len(errors) == 1 and events[-2] == errors[0]:
        return "error-done", f"error event {errors[0][:120]} then [DONE]"
    return "bad", f"errors mid-stream: {errors[:2]}"


def metric(port: int, name: str) -> float:
    text = request(port, "GET", "/metrics", key=None)[1].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def check_streaming(port: int) -> None:
    events: list[str] = []
    read_stream(port, {**CHAT, "max_tokens": 16, "stream": True}, events)
    kind, reason = stream_end(events)
    check("9 streamed chat ends with data: [DONE]", kind == "done", reason)
    aborted = metric(port, "vllm:request_aborted_total")
    long = {**CHAT, "max_tokens": 450, "ignore_eos": True, "stream": True}
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    body = json.dumps(long).encode()
    s.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    got = b""
    while got.count(b"data:") < 3:
        got += s.recv(4096)
    s.close()
    t0 = time.monotonic()
    r = client(port).chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=16)
    took = time.monotonic() - t0
    check(
        "9 request after a mid-stream disconnect",
        r.choices[0].finish_reason in ("stop", "length") and took < 5,
        f"finish={r.choices[0].finish_reason} in {took:.2f} s",
    )
    deadline = time.monotonic() + 2
    while metric(port, "vllm:request_aborted_total") <= aborted and time.monotonic() < deadline:
        time.sleep(0.1)
    health = json.loads(request(port, "GET", "/health", key=None)[1])
    check(
        "9 disconnected stream aborted",
        metric(port, "vllm:request_aborted_total") > aborted and health.get("running") == 0,
        f"aborted_total {aborted} -> {metric(port, 'vllm:request_aborted_total')}"
        f", running={health.get('running')}",
    )


def check_concurrency(port: int) -> None:
    c = client(port)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def add(a, b):"]

    def one(i: int, stream: bool) -> tuple[int, str, str | None]:
        p, chat = prompts[i % 4], (i // 4) % 2 == 1
        kw = {"model": MODEL, "max_tokens": 8, "temperature": 0, "stream": stream}
        if chat:
            r = c.chat.completions.create(messages=[{"role": "user", "content": p}], **kw)
            if not stream:
                return i, r.choices[0].message.content, r.choices[0].finish_reason
            parts = [
                (ch.choices[0].delta.content or "", ch.choices[0].finish_reason) for ch in r if ch.choices
            ]
        else:
            r = c.completions.create(prompt=p, **kw)
            if not stream:
                return i, r.choices[0].text, r.choices[0].finish_reason
            parts = [(ch.choices[0].text, ch.choices[0].finish_reason) for ch in r if ch.choices]
        return i, "".join(t for t, _ in parts), next((f for _, f in parts if f), None)

    base = {i: one(i, False)[1] for i in range(8)}
    with ThreadPoolExecutor(32) as pool:
        futs = [pool.submit(one, i, i % 3 == 0) for i in range(32)]
        results, errors = [], []
        for f in futs:
            try:
                results.append(f.result())
            except Exception as e:  # noqa: BLE001 - any client error is a failed request
                errors.append(f"{type(e).__name__}: {e}"[:100])
    wrong = [
        (i, t, base[i % 8]) for i, t, fin in results if t != base[i % 8] or fin not in ("stop", "length")
    ]
    check(
        "12 32 concurrent requests (mixed stream) all correct",
        not errors and not wrong,
        f"{len(results)} ok, errors={errors[:2]}, mismatches vs sequential={wrong[:2]}",
    )


def check_slow_clients(port: int, log: Path) -> None:
    socks = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        socks.append(s)
    opened = time.monotonic()
    t0 = time.monotonic()
    status = request(port, "GET", "/health", key=None, timeout=5)[0]
    took = time.monotonic() - t0
    check("4 /health under 50 stalled sockets < 2 s", status == 200 and took < 2, f"{status} in {took:.2f} s")
    time.sleep(max(0.0, 12.5 - (time.monotonic() - opened)))
    still_open = 0
    for s in socks:
        s.settimeout(0.5)
        try:
            while s.recv(4096):
                pass
        except TimeoutError:
            still_open += 1
        except OSError:
            pass
        s.close()
    check(
        "4 stalled sockets closed by the server after ~12 s", still_open == 0, f"{still_open}/50 still open"
    )
    tb = log.read_text(errors="replace").count("Traceback")
    check("4 no tracebacks in server log", tb == 0, f"{tb} tracebacks")


def check_sigterm(port: int, proc: subprocess.Popen, log: Path, name: str, max_tokens: int) -> None:
    events: list[str] = []
    started = threading.Event()
    body = {**CHAT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    reader = threading.Thread(target=read_stream, args=(port, body, events, started))
    reader.start()
    started.wait(30)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        drained = error_shape(*request(port, "POST", "/v1/completions", CMPL, timeout=5), (503,))[1]
        health = request(port, "GET", "/health", key=None, timeout=5)[0]
    except OSError as e:
        drained, health = f"<{type(e).__name__}>", 0
    check(
        f"10 {name}: new requests 503 while draining",
        drained.startswith("503") and health == 503,
        f"completions {drained}; /health {health}",
    )
    try:
        rc = proc.wait(35)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = None
    took = time.monotonic() - t0
    reader.join(10)
    check(f"10 {name}: exits 0 within 30 s", rc == 0 and took <= 30, f"exit {rc} after {took:.1f} s")
    kind, reason = stream_end(events)
    check(f"10 {name}: in-flight stream ends cleanly", kind != "bad", f"{kind}: {reason}")
    tb = log.read_text(errors="replace").count("Traceback")
    check(f"10 {name}: no tracebacks in server log", tb == 0, f"{tb} tracebacks")


def main() -> int:
    t_start = time.monotonic()
    check_start_refusals()
    port = free_port()
    proc, log = start_server(port)
    print(f"server on 127.0.0.1:{port}, log {log}", flush=True)
    try:
        check_binding(port)
        check_auth(port)
        check_types(port)
        check_bodies(port)
        check_list_limits(port)
        check_streaming(port)
        check_concurrency(port)
        check_slow_clients(port, log)
        check_sigterm(port, proc, log, "SIGTERM, default timeout", 450)
        port2 = free_port()
        proc2, log2 = start_server(port2, "--shutdown-timeout", "1", "--max-model-len", "2048")
        check_sigterm(port2, proc2, log2, "SIGTERM, --shutdown-timeout 1", 1800)
        proc3, _ = start_server(port)
        check("10 restarts on the same port", proc3.poll() is None, "healthy again")
        proc3.terminate()
        proc3.wait(30)
    finally:
        for p in [proc, *[v for k, v in locals().items() if k in ("proc2", "proc3")]]:
            if p.poll() is None:
                p.kill()
    print(f"{len(FAILED)} FAILED; ran {time.monotonic() - t_start:.0f} s", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
