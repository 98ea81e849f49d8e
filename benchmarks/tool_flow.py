"""The official `openai` client's tool flow against a real `verispec serve`: the model picks a tool (tool_choice
"auto" through the hermes parser, then "required"), its arguments are checked against the tool's schema, the tool's
result goes back in a follow-up turn and the model answers in text. With and without speculation.

    .venv/bin/python benchmarks/tool_flow.py --model qwen2.5-coder-1.5b-instruct --output tool_flow.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jsonschema
import openai
from adaptive_k import cpu_model
from serve_load import ManagedServer
from structured_data import TOOL_REQUESTS, TOOLS

FAKE_RESULTS = {
    "get_weather": {"temperature": 18, "condition": "cloudy"},
    "convert_currency": {"result": 231.5},
    "search_flights": {"flights": [{"number": "UA 512", "departs": "08:10"}]},
    "create_event": {"created": True},
}


def one_flow(client: openai.OpenAI, model: str, question: str, choice: str) -> dict:
    """A tool call, the fake result back, the final answer -> what happened."""
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    messages = [{"role": "user", "content": question}]
    t = time.perf_counter()
    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=160
    )
    msg = r.choices[0].message
    calls = msg.tool_calls or []
    out = {
        "question": question,
        "tool_choice": choice,
        "finish_reason": r.choices[0].finish_reason,
        "calls": [],
    }
    for c in calls:
        args = json.loads(c.function.arguments)
        ok = c.function.name in by_name
        if ok:
            try:
                jsonschema.validate(args, by_name[c.function.name])
            except jsonschema.ValidationError:
                ok = False
        out["calls"].append({"name": c.function.name, "arguments": args, "valid": ok})
    if calls:
        messages.append(msg.model_dump(exclude_none=True))
        for c in calls:
            result = FAKE_RESULTS.get(c.function.name, {})
            messages.append({"role": "tool", "tool_call_id": c.id, "content": json.dumps(result)})
        r2 = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=80
        )
        out["answer"] = r2.choices[0].message.content
    out["seconds"] = time.perf_counter() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default=None)
    ap.add_argument("--log-dir", default="bench_results", help="where the servers' logs go")
    args = ap.parse_args()
    results = {}
    tools = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--threads", str(args.threads))
    for label, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 8})):
        server = ManagedServer(
            args.model, spec, 4096, 4, Path(args.log_dir) / f"tool_flow_{label}.log", tools
        )
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=600)
        try:
            server.wait_ready()
            results[label] = [
                one_flow(client, args.model, q, c) for q in TOOL_REQUESTS for c in ("auto", "required")
            ]
        finally:
            server.stop()
    print(f"model {args.model}, {cpu_model()}, greedy")
    print(
        f"{'server':6s} {'tool_choice':11s} {'flows':>5s} {'called':>6s} {'valid args':>10s} {'answered':>8s} {'s':>6s}"
    )
    for label, flows in results.items():
        for choice in ("auto", "required"):
            fl = [f for f in flows if f["tool_choice"] == choice]
            called = sum(bool(f["calls"]) for f in fl)
            valid = sum(all(c["valid"] for c in f["calls"]) and bool(f["calls"]) for f in fl)
            answered = sum(bool(f.get("answer")) for f in fl)
            secs = sum(f["seconds"] for f in fl)
            print(f"{label:6s} {choice:11s} {len(fl):5d} {called:6d} {valid:10d} {answered:8d} {secs:6.1f}")
    same = [a["calls"] == b["calls"] for a, b in zip(results["plain"], results["ngram"])]
    print(f"ngram's tool calls equal plain decoding's: {sum(same)}/{len(same)}")
    if args.output:
        out = {"model": args.model, "cpu": cpu_model(), "results": results}
        Path(args.output).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
