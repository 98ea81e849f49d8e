"""Tensor parallelism against one process: decode speed at TP=1 (every thread in one process) and TP=N (the threads
shared out, one process per rank), plain and speculative, every output compared.

    python benchmarks/tensor_parallel.py --model qwen2.5-coder-1.5b-instruct --sizes 1,2 --methods none,ngram

Each (size, method) runs in a fresh process (an engine per run; the other ranks are its children): one warm-up
request, then --repeats timed greedy requests on code-editing prompts, each also run for one token first: the decode
rate leaves that prompt time out. Prints a
table, writes JSON. Greedy output must be identical between plain and speculative runs of one size (lossless); the
TP=N output is compared with TP=1's too (it may differ: the sums of the ranks' partial products are ordered
differently, docs/parallelism.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from adaptive_k import cpu_model

_CHILD = r"""
import json, statistics, sys, time
spec = json.loads(sys.argv[1])
from verispec import LLM, SamplingParams
from verispec.workloads import build_workload, chat_prompt_ids
method = spec["method"]
sc = None if method == "none" else {"method": method, "num_speculative_tokens": 5, "prompt_lookup_max": 5}
llm = LLM(
    spec["model"], max_model_len=2048, max_num_seqs=1, activation_dtype=spec["dtype"], enable_prefix_caching=False,
    tensor_parallel_size=spec["size"], threads=spec["threads"], speculative_config=sc,
)
ids = chat_prompt_ids(llm.get_tokenizer(), build_workload("code-edit", spec["repeats"] + 1))
prompts = [{"prompt_token_ids": p} for p in ids]
sp = SamplingParams(temperature=0, max_tokens=spec["tokens"], ignore_eos=True)
first = SamplingParams(temperature=0, max_tokens=1)
llm.generate(prompts[:1], sp, use_tqdm=False)
rates, outs, total = [], [], 0.0
for p in prompts[1:]:
    t = time.perf_counter()
    llm.generate([p], first, use_tqdm=False)
    t_prompt = time.perf_counter() - t
    t = time.perf_counter()
    o = llm.generate([p], sp, use_tqdm=False)[0]
    dt = time.perf_counter() - t
    total += dt
    outs.append(list(o.outputs[0].token_ids))
    rates.append((len(outs[-1]) - 1) / max(dt - t_prompt, 1e-9))
print(json.dumps({"decode_tok_s": statistics.median(rates), "seconds": total, "outputs": outs}))
llm.shutdown()
"""


def run(model: str, size: int, method: str, args) -> dict:
    spec = {
        "model": model,
        "size": size,
        "method": method,
        "dtype": args.activation_dtype,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "threads": args.threads,
    }
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"size {size} {method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--methods", default="none,ngram")
    ap.add_argument("--activation-dtype", default="float32", choices=["float32", "int8"])
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="threads in all (shared by ranks)"
    )
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", help="JSON file for the results")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    methods = args.methods.split(",")
    rows = []
    for size in sizes:
        for method in methods:
            r = run(args.model, size, method, args)
            rows.append({"size": size, "method": method, **r})
    # ratios against TP=1 whatever order the sizes ran in (--sizes 2,1 runs TP=2 first)
    base_size = 1 if 1 in sizes else sizes[0]
    base = {r["method"]: r for r in rows if r["size"] == base_size}
    plain = {r["size"]: r for r in rows if r["method"] == methods[0]}
    print(f"{args.model}, {args.activation_dtype}, {args.threads} threads in all, {cpu_model()}")
    print("| TP | method | decode tok/s | vs TP=1 | vs plain | same as plain | same as TP=1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        b, p = base[r["method"]], plain[r["size"]]
        r["vs_tp1"] = r["decode_tok_s"] / b["decode_tok_s"]
        r["vs_plain"] = r["decode_tok_s"] / p["decode_tok_s"]
        r["same_as_plain"] = r["outputs"] == p["outputs"]
        r["same_as_tp1"] = r["outputs"] == b["outputs"]
        print(
            f"| {r['size']} | {r['method']} | {r['decode_tok_s']:.1f} | {r['vs_tp1']:.2f}x | {r['vs_plain']:.2f}x | "
            f"{r['same_as_plain']} | {r['same_as_tp1']} |"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"cpu": cpu_model(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
