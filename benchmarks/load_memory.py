"""Engine ready time and resident memory, verispec beside llama.cpp, each load in a fresh process.

    python benchmarks/load_memory.py --model qwen2.5-coder-1.5b-instruct --runs 2 --output bench_results/load.json

Per engine and run: seconds from the process's start of loading to a model ready to generate (verispec: `LLM(...)`,
which also builds the KV cache and the step-cost profile; llama.cpp: `Llama(...)`), then the resident set after
generating --tokens tokens greedily (VmRSS) and the peak (VmHWM), same context length and thread count. verispec's
runs share a repacked-layout cache (verispec/loader/layout_cache.py) of their own, empty before run 1: run 1 is a
first load of the file (it repacks and writes the cache), later runs read it. The first run of a verispec build
also compiles its kernels. llama.cpp runs if llama-cpp-python is installed (benchmarks/llama_cpp_peer.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import llama_cpp_peer
from adaptive_k import cpu_model

PROMPT = "def quicksort(arr):"

_CHILD = r"""
import json, re, sys, time
spec = json.loads(sys.argv[1])

def mem():
    s = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\s+(\d+)", s).group(1)) / 1e6 for k in ("VmRSS", "VmHWM")}

if spec["engine"] == "verispec":
    import torch
    torch.set_num_threads(spec["threads"])
    from verispec import LLM, SamplingParams
    t = time.perf_counter()
    llm = LLM(spec["model"], max_model_len=spec["ctx"], max_num_seqs=1, activation_dtype=spec["dtype"])
    ready = time.perf_counter() - t
    sp = SamplingParams(temperature=0, max_tokens=spec["tokens"], ignore_eos=True)
    llm.generate([spec["prompt"]], sp, use_tqdm=False)
else:
    sys.path.insert(0, spec["bench_dir"])
    import llama_cpp_peer
    t = time.perf_counter()
    llm = llama_cpp_peer.load(spec["path"], spec["threads"], n_ctx=spec["ctx"])
    ready = time.perf_counter() - t
    llm.create_completion(spec["prompt"], max_tokens=spec["tokens"], temperature=0)
print(json.dumps({"ready_s": ready, **mem()}))
"""


def run_child(spec: dict, env: dict | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True, check=False, env=env
    )
    if out.returncode != 0:
        raise SystemExit(f"{spec['engine']} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a named model or a .gguf file")
    ap.add_argument("--runs", type=int, default=2, help="fresh processes per engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048, help="context length of both engines")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens generated before reading memory")
    ap.add_argument("--activation-dtype", default="float32", choices=["float32", "int8"])
    ap.add_argument("--output", help="JSON file for the results")
    args = ap.parse_args()

    from verispec.loader.checkpoint import resolve_model_path

    path = str(resolve_model_path(args.model))
    common = dict(model=args.model, path=path, threads=args.threads, ctx=args.ctx, tokens=args.tokens)
    common |= dict(prompt=PROMPT, dtype=args.activation_dtype, bench_dir=str(Path(__file__).parent))
    engines = ["verispec"] + (["llama.cpp"] if llama_cpp_peer.available() else [])
    rows = []
    layouts = tempfile.TemporaryDirectory(prefix="verispec-layouts-")
    env = os.environ | {"VERISPEC_LAYOUT_CACHE": layouts.name}
    for engine in engines:
        for run in range(1, args.runs + 1):
            r = run_child({**common, "engine": engine}, env)
            rows.append({"engine": engine, "run": run, **r})
            print(
                f"{engine:10} run {run}: ready {r['ready_s']:6.2f} s  rss {r['VmRSS']:.2f} GB  peak {r['VmHWM']:.2f} GB"
            )
    print(
        f"\n{args.model}, {args.threads} threads, context {args.ctx}, {args.activation_dtype}; CPU: {cpu_model()}"
    )
    print("| engine | ready, run 1 (s) | ready, last run (s) | resident (GB) | peak (GB) |")
    print("| --- | --- | --- | --- | --- |")
    for engine in engines:
        runs = [r for r in rows if r["engine"] == engine]
        first, last = runs[0], runs[-1]
        print(
            f"| {engine} | {first['ready_s']:.2f} | {last['ready_s']:.2f} | {last['VmRSS']:.2f} | {last['VmHWM']:.2f} |"
        )
    layouts.cleanup()
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": args.model, "cpu": cpu_model(), "threads": args.threads, "ctx": args.ctx}
        Path(args.output).write_text(
            json.dumps({"meta": meta | {"dtype": args.activation_dtype}, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
