"""Decode speed alone and beside one busy process (a Python busy loop on another core), per thread policy.

    python benchmarks/busy_neighbour.py --model qwen2.5-coder-1.5b-instruct --policies default,fixed,PASSIVE

default: the engine's (its thread governor, verispec/engine/threads.py, drops to one thread while the cores are
shared); fixed: every thread throughout (VERISPEC_ADAPTIVE_THREADS=0); PASSIVE: OpenMP's passive wait policy;
spin=N: GOMP_SPINCOUNT=N.

Each policy runs in a fresh process (libgomp reads OMP_WAIT_POLICY when it loads): the same greedy request is timed
alone (median of --repeats), then --repeats times while the busy loop runs. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from adaptive_k import cpu_model

_CHILD = r"""
import json, statistics, subprocess, sys, time
spec = json.loads(sys.argv[1])
from verispec import LLM, SamplingParams
# the same prompt every run: no prefix cache
llm = LLM(
    spec["model"], max_model_len=1024, max_num_seqs=1, activation_dtype=spec["dtype"], enable_prefix_caching=False
)
sp = SamplingParams(temperature=0, max_tokens=spec["tokens"], ignore_eos=True)
llm.generate(["def f(x):"], sp, use_tqdm=False)

def rate():
    t = time.perf_counter()
    llm.generate(["def quicksort(arr):"], sp, use_tqdm=False)
    return spec["tokens"] / (time.perf_counter() - t)

alone = [rate() for _ in range(spec["repeats"])]
busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
try:
    time.sleep(0.5)
    shared = [rate() for _ in range(spec["repeats"])]
finally:
    busy.kill()
print(json.dumps({"alone": statistics.median(alone), "shared": statistics.median(shared)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument(
        "--policies",
        default="default,fixed",
        help="default (the thread governor), fixed (governor off), OMP_WAIT_POLICY values, spin=N (GOMP_SPINCOUNT)",
    )
    ap.add_argument("--activation-dtype", default="int8", choices=["float32", "int8"])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", help="JSON file for the results")
    args = ap.parse_args()
    spec = {
        "model": args.model,
        "dtype": args.activation_dtype,
        "tokens": args.tokens,
        "repeats": args.repeats,
    }
    rows = []
    for policy in args.policies.split(","):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        if policy == "fixed":
            env["VERISPEC_ADAPTIVE_THREADS"] = "0"
        elif policy.startswith("spin="):
            # libgomp's spin count before a waiting thread sleeps (unset: 300,000 with free cores)
            env["GOMP_SPINCOUNT"] = policy.removeprefix("spin=")
        elif policy != "default":
            env["OMP_WAIT_POLICY"] = policy
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            raise SystemExit(f"policy {policy} failed:\n{out.stderr[-2000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"policy": policy, **r, "slowdown": r["alone"] / r["shared"]})
    print(
        f"\n{args.model}, {args.activation_dtype}, {args.tokens} tokens, median of {args.repeats}; CPU: {cpu_model()}"
    )
    print("| thread policy | alone tok/s | beside a busy process | slowdown |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['policy']} | {r['alone']:.1f} | {r['shared']:.1f} | {r['slowdown']:.1f}x |")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"cpu": cpu_model(), **spec, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
