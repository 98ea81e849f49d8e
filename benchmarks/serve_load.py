"""Load benchmark for `verispec serve`: N concurrent streaming clients, with and without speculation.

Starts one server per mode itself (or measures a running one with --url), runs each concurrency level on a
workload (JSONL, one {"prompt": ...} or {"messages": [...]} per line; default: small code-editing chats built
inline), prints a table and writes JSON.

    python benchmarks/serve_load.py --model smollm2-135m-instruct --concurrency 1 4 16 --num-requests 16

Metrics (vLLM's benchmark_serving definitions): output throughput = completion tokens / wall time; TTFT = request
start to first content chunk; ITL = gaps between content chunks (a speculative step may deliver several tokens in
one chunk); TPOT = (e2e - TTFT) / (completion tokens - 1).

`--rounds N` keeps every mode's server up and measures the modes N times in turn (each round starting at another
mode; an idle server sleeps), so the machine's drift falls on all alike; the summary gives each mode's median round
and spec / plain as the median over rounds of the ratio within a round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}

_SNIPPETS = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n",
    "def greet(name):\n    message = 'Hello, ' + name + '!'\n    print(message)\n    return message\n",
    "def is_even(n):\n    if n % 2 == 0:\n        return True\n    else:\n        return False\n",
    "def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n        return high\n"
    "    return value\n",
]
_EDITS = [
    "Rename the function to use a clearer name and return the full updated code.",
    "Add type hints to the function and return the full updated code.",
    "Replace single quotes with double quotes and return the full updated code.",
    "Add a one-line docstring and return the full updated code.",
]


def default_workload(n: int) -> list[dict]:
    """Input-grounded code edits: the answer repeats most of the prompt, where n-gram speculation shines."""
    return [
        {
            "messages": [
                {
                    "role": "user",
                    "content": f"{_EDITS[i % len(_EDITS)]}\n\n```python\n"
                    f"{_SNIPPETS[(i // len(_EDITS) + i) % len(_SNIPPETS)]}```",
                }
            ]
        }
        for i in range(n)
    ]


def load_workload(path: str | None, n: int) -> list[dict]:
    if path is None:
        return default_workload(n)
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows or not all("prompt" in r or "messages" in r for r in rows):
        raise SystemExit(f"{path}: every line must be a JSON object with 'prompt' or 'messages'")
    return (rows * (n // len(rows) + 1))[:n]


# ---------------------------------------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedServer:
    def __init__(
        self,
        model: str,
        spec: dict | None,
        max_model_len: int,
        max_num_seqs: int,
        log: Path,
        extra: tuple[str, ...] = (),
    ):
        """extra: more `verispec serve` arguments."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "verispec.server.cli",
            model,
            "--port",
            str(self.port),
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            str(max_num_seqs),
            "--disable-uvicorn-access-log",
            *extra,
        ]
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with code {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"server not ready after {timeout}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# ---------------------------------------------------------------------------------------------- client


@dataclass
class RequestResult:
    ok: bool
    completion_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, item: dict, max_tokens: int, temperature: float
) -> RequestResult:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if "messages" in item:
        path, body["messages"] = "/v1/chat/completions", item["messages"]
    else:
        path, body["prompt"] = "/v1/completions", item["prompt"]
    start = time.perf_counter()
    res, last = RequestResult(ok=False), None
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(ok=False, error=chunk["error"]["message"])
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
    except httpx.HTTPError as e:
        return RequestResult(ok=False, error=repr(e))
    res.e2e = time.perf_counter() - start
    res.ok = True
    return res


async def run_level(
    url: str,
    model: str,
    items: list[dict],
    concurrency: int,
    max_tokens: int,
    temperature: float,
    api_key: str | None,
) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue: asyncio.Queue = asyncio.Queue()
    for it in items:
        queue.put_nowait(it)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), headers=headers, limits=limits) as client:

        async def worker():
            while not queue.empty():
                item = queue.get_nowait()
                results.append(await one_request(client, url, model, item, max_tokens, temperature))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return results, time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def _scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "per_pos" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


def summarize(
    mode: str, conc: int, results: list[RequestResult], wall: float, before: dict, after: dict
) -> dict:
    ok = [r for r in results if r.ok]
    toks = sum(r.completion_tokens for r in ok)
    itl = [x for r in ok for x in r.itl]
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    drafts = after.get("vllm:spec_decode_num_drafts_total", 0) - before.get(
        "vllm:spec_decode_num_drafts_total", 0
    )
    drafted = after.get("vllm:spec_decode_num_draft_tokens_total", 0) - before.get(
        "vllm:spec_decode_num_draft_tokens_total", 0
    )
    accepted = after.get("vllm:spec_decode_num_accepted_tokens_total", 0) - before.get(
        "vllm:spec_decode_num_accepted_tokens_total", 0
    )
    return {
        "mode": mode,
        "concurrency": conc,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "completion_tokens": toks,
        "wall_s": wall,
        "output_tok_s": toks / wall if wall else 0.0,
        "ttft_p50_s": _pct([r.ttft for r in ok], 50),
        "ttft_p99_s": _pct([r.ttft for r in ok], 99),
        "itl_p50_s": _pct(itl, 50),
        "itl_p99_s": _pct(itl, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "e2e_mean_s": statistics.fmean([r.e2e for r in ok]) if ok else float("nan"),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'mode':<6} {'conc':>4} {'reqs':>4} {'fail':>4} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>9} {'TPOT p99':>9} {'accept':>6} {'AL':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        al = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "-"
        print(
            f"{r['mode']:<6} {r['concurrency']:>4} {r['requests']:>4} {r['failed']:>4} {r['output_tok_s']:>8.2f} "
            f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p99_s']:>8.3f}s {r['itl_p50_s']:>7.3f}s {r['itl_p99_s']:>7.3f}s "
            f"{r['tpot_p50_s']:>8.3f}s {r['tpot_p99_s']:>8.3f}s {acc:>6} {al:>5}"
        )


def print_rounds(rows: list[dict], levels: list[int]) -> None:
    """Each mode's median round by tok/s, and spec / plain as the median over rounds of the ratio within a round."""
    print()
    for conc in levels:
        by_mode: dict[str, list[float]] = {}
        for r in rows:
            if r["concurrency"] == conc:
                by_mode.setdefault(r["mode"], []).append(r["output_tok_s"])
        text = ", ".join(
            f"{m} {statistics.median(v):.2f} tok/s (rounds {'/'.join(f'{x:.0f}' for x in v)})"
            for m, v in by_mode.items()
        )
        if "plain" in by_mode and "spec" in by_mode:
            ratio = statistics.median(s / p for s, p in zip(by_mode["spec"], by_mode["plain"]))
            text += f"; spec / plain {ratio:.2f}x (median within-round ratio)"
        print(f"concurrency {conc}: {text}")


def offline_gain(args, spec: dict, n: int) -> dict:
    """The same workload through LLM.generate at batch 1, plain vs speculative: the gain the server should keep."""
    from verispec import LLM, SamplingParams

    items = load_workload(args.workload, n)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    out = {}
    for mode, cfg in (("plain", None), ("spec", spec)):
        llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=1, speculative_config=cfg)
        tok = llm.tokenizer
        prompts = [
            {
                "prompt_token_ids": tok.encode(
                    tok.apply_chat_template(it["messages"]), add_special_tokens=False
                )
            }
            if "messages" in it
            else it["prompt"]
            for it in items
        ]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        t = time.perf_counter()
        res = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        out[mode] = sum(len(r.outputs[0].token_ids) for r in res) / dt
        del llm
    out["gain"] = out["spec"] / out["plain"]
    print(
        f"offline batch 1: plain {out['plain']:.2f} tok/s, spec {out['spec']:.2f} tok/s, gain {out['gain']:.2f}x"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--url", default=None, help="measure a running server instead of starting servers")
    p.add_argument("--served-model-name", default=None, help="model name to send (default --model)")
    p.add_argument("--api-key", default=os.environ.get("VERISPEC_API_KEY"))
    p.add_argument("--workload", default=None, help="JSONL file of {'prompt'} / {'messages'} rows")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--num-requests", type=int, default=None, help="per level (default 2 x concurrency, >= 4)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--modes", nargs="+", default=["plain", "spec"], choices=["plain", "spec"])
    p.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC))
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--output", default="bench_results/serve_load.json")
    p.add_argument(
        "--offline", action="store_true", help="also run the workload offline at batch 1 for comparison"
    )
    p.add_argument("--rounds", type=int, default=1, help="measure the modes this many times in turn (>= 1)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    spec = json.loads(args.speculative_config)
    offline = offline_gain(args, spec, args.num_requests or 16) if args.offline else None
    modes = ["url"] if args.url else args.modes
    name = args.served_model_name or args.model
    rows = []
    servers: dict[str, ManagedServer] = {}
    urls: dict[str, str] = {}
    try:
        for mode in modes:
            urls[mode] = args.url
            if args.url is None:
                log = ROOT / "bench_results" / f"serve_load_{mode}.log"
                print(f"[{mode}] starting server for {args.model} (log: {log})", flush=True)
                servers[mode] = ManagedServer(
                    args.model, spec if mode == "spec" else None, args.max_model_len, args.max_num_seqs, log
                )
                servers[mode].wait_ready()
                urls[mode] = servers[mode].url
            warm = load_workload(args.workload, 1)
            asyncio.run(
                run_level(urls[mode], name, warm, 1, min(8, args.max_tokens), args.temperature, args.api_key)
            )
        for r in range(args.rounds):
            # each round starts at another mode
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                url = urls[mode]
                for conc in args.concurrency:
                    n = args.num_requests or max(4, 2 * conc)
                    items = load_workload(args.workload, n)
                    before = _scrape(url)
                    results, wall = asyncio.run(
                        run_level(url, name, items, conc, args.max_tokens, args.temperature, args.api_key)
                    )
                    rows.append(summarize(mode, conc, results, wall, before, _scrape(url)) | {"round": r})
                    print_table(rows[-1:])
    finally:
        for server in servers.values():
            server.stop()
    if args.rounds > 1:
        print_rounds(rows, args.concurrency)
    print()
    print_table(rows)
    served = {(r["mode"], r["concurrency"]): r for r in rows}
    if offline and ("plain", 1) in served and ("spec", 1) in served:
        gain = served[("spec", 1)]["output_tok_s"] / served[("plain", 1)]["output_tok_s"]
        print(
            f"concurrency 1 speculative gain: server {gain:.2f}x vs offline {offline['gain']:.2f}x "
            f"({100 * gain / offline['gain']:.0f}% carried over)"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k != "api_key"}
    out.write_text(json.dumps({"config": meta, "results": rows, "offline": offline}, indent=2))
    print(f"\nwrote {out}")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
