"""Data parallelism against one engine: `verispec serve -dp N` (the threads shared out, one replica process each)
vs one engine with every thread, on the same machine, one server at a time.

    python benchmarks/data_parallel.py --model qwen2.5-coder-1.5b-instruct --dp 2 --concurrency 16

Two measures per server: output tokens per second for --num-requests code-editing chats sent --concurrency at a
time (serve_load's streaming client), and the prefix-cache hit rate of a multi-turn workload (--chats
conversations of --turns turns, each turn the whole history plus the model's answers; the turns of all chats
interleaved, --concurrency at a time), read from /metrics. --rounds alternates the two servers. Prints a table,
writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from pathlib import Path

import httpx
from adaptive_k import cpu_model
from serve_load import ManagedServer, default_workload, run_level

ROOT = Path(__file__).resolve().parents[1]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def chat_turns(url: str, model: str, chats: int, turns: int, concurrency: int, max_tokens: int) -> None:
    """Every chat's turns in order, the chats side by side (at most `concurrency` requests at a time)."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:

        async def chat(i: int) -> None:
            messages = [{"role": "system", "content": f"You are assistant number {i}. " + "Be brief. " * 40}]
            for t in range(turns):
                messages.append(
                    {"role": "user", "content": f"Chat {i}, turn {t}: name a prime above {i * 7 + t}."}
                )
                async with gate:
                    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
                    r = await client.post(f"{url}/v1/chat/completions", json=body)
                r.raise_for_status()
                messages.append(
                    {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
                )

        await asyncio.gather(*[chat(i) for i in range(chats)])


def measure(args, extra: tuple[str, ...], name: str) -> dict:
    log = ROOT / "bench_results" / f"data_parallel_{name}.log"
    server = ManagedServer(args.model, None, args.max_model_len, args.max_num_seqs, log, extra)
    try:
        server.wait_ready()
        items = default_workload(args.num_requests)
        asyncio.run(run_level(server.url, args.model, items[:2], 2, 8, 0.0, None))
        results, wall = asyncio.run(
            run_level(server.url, args.model, items, args.concurrency, args.max_tokens, 0.0, None)
        )
        tokens = sum(r.completion_tokens for r in results if r.ok)
        q0 = metric(server.url, "vllm:prefix_cache_queries_total")
        h0 = metric(server.url, "vllm:prefix_cache_hits_total")
        asyncio.run(chat_turns(server.url, args.model, args.chats, args.turns, args.concurrency, 24))
        queries = metric(server.url, "vllm:prefix_cache_queries_total") - q0
        hits = metric(server.url, "vllm:prefix_cache_hits_total") - h0
        failed = sum(not r.ok for r in results)
    finally:
        server.stop()
    return {"tok_s": tokens / wall, "wall": wall, "hit_rate": hits / max(queries, 1), "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads in all")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--output", default="bench_results/data_parallel.json")
    args = ap.parse_args()
    modes = {
        "one engine": ("--threads", str(args.threads)),
        f"dp={args.dp}": ("--threads", str(args.threads), "--data-parallel-size", str(args.dp)),
    }
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = list(modes) if r % 2 == 0 else list(modes)[::-1]
        for m in order:
            runs[m].append(measure(args, modes[m], m.replace(" ", "_").replace("=", "")))
    print(f"{args.model}, {args.threads} threads in all, concurrency {args.concurrency}, {cpu_model()}")
    print("| server | output tok/s | vs one engine | prefix hit rate (multi-turn) | vs one engine | failed |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = {k: statistics.median(x[k] for x in runs["one engine"]) for k in ("tok_s", "hit_rate")}
    rows = []
    for m, xs in runs.items():
        tok = statistics.median(x["tok_s"] for x in xs)
        hit = statistics.median(x["hit_rate"] for x in xs)
        rows.append({"server": m, "tok_s": tok, "hit_rate": hit, "runs": xs})
        print(
            f"| {m} | {tok:.1f} | {tok / base['tok_s']:.2f}x | {hit:.1%} | {hit / max(base['hit_rate'], 1e-9):.2f}x "
            f"| {sum(x['failed'] for x in xs)} |"
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"cpu": cpu_model(), "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
