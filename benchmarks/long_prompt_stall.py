"""What a long prompt does to the requests already streaming: chunked prefill alternating with decode steps (the
engine's policy) beside prefill-first (every chunk before any decode step, the policy before it), in one process.

    python benchmarks/long_prompt_stall.py --model qwen2.5-coder-1.5b-instruct --output long_prompt_stall.json

--running chats decode; once each has its first tokens, a --prompt-tokens prompt (the start of engine.py) arrives.
Until its first token: the running requests' longest gap between two steps that gave them tokens, the tokens they
got, and the long prompt's time to first token. Greedy; the outputs of both policies are compared.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from adaptive_k import cpu_model

from verispec import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "verispec" / "engine" / "engine.py"
CHATS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in three sentences.",
    "List five uses of the Unix tool grep.",
    "Write a haiku about compilers.",
]


def run(llm: LLM, prompt_tokens: int, running: int, max_tokens: int, prefill_first: bool) -> dict:
    engine, tok = llm.engine, llm.engine.tokenizer
    tag = "first" if prefill_first else "alt"
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(running):
        ids = tok.encode(CHATS[i % len(CHATS)])
        engine.add_request(f"{tag}-chat{i}", None, ids, sp)
    chats = [f"{tag}-chat{i}" for i in range(running)]
    while any(not engine.requests[c].output_token_ids for c in chats):
        engine.step()
    long_ids = tok.encode(SOURCE.read_text())[:prompt_tokens]
    engine.add_request(
        f"{tag}-long", None, long_ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    t0 = last = time.perf_counter()
    counts = {c: len(engine.requests[c].output_token_ids) for c in chats}
    start = dict(counts)
    gap = 0.0
    while not engine.requests[f"{tag}-long"].output_token_ids:
        if prefill_first:
            # the earlier policy: no decode step until every prompt chunk is done
            engine._prefilled = False
        engine.step()
        now = time.perf_counter()
        grown = {c: len(engine.requests[c].output_token_ids) for c in chats}
        if any(grown[c] > counts[c] for c in chats):
            gap, last = max(gap, now - last), now
        counts = grown
    ttft = time.perf_counter() - t0
    gap = max(gap, time.perf_counter() - last)
    outputs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outputs[o.request_id.split("-", 1)[1]] = o.outputs[0].token_ids
    return {
        "longest_gap_s": round(gap, 3),
        "tokens_during_prefill": sum(counts[c] - start[c] for c in chats),
        "long_ttft_s": round(ttft, 3),
        "outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--running", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens")
    ap.add_argument("--activation-dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    llm = LLM(
        args.model,
        max_model_len=4096,
        max_num_seqs=args.running + 1,
        max_num_batched_tokens=args.chunk,
        enable_prefix_caching=False,
        activation_dtype=args.activation_dtype,
        threads=args.threads,
    )
    # warm-up: kernels, the step-cost profile
    llm.generate(CHATS[0], SamplingParams(max_tokens=4), use_tqdm=False)
    rows = {}
    for name, first in (("alternate", False), ("prefill first", True)):
        rows[name] = run(llm, args.prompt_tokens, args.running, args.max_tokens, first)
    same = rows["alternate"].pop("outputs") == rows["prefill first"].pop("outputs")
    cpu = cpu_model()
    print(f"{args.model}, {args.activation_dtype}, {args.threads} threads, {cpu}")
    print(
        f"{args.running} chats decoding, a {args.prompt_tokens}-token prompt arrives, chunks of {args.chunk}"
    )
    print(f"{'policy':>14}  {'longest stall s':>15}  {'chat tokens meanwhile':>21}  {'long TTFT s':>11}")
    for name, r in rows.items():
        print(
            f"{name:>14}  {r['longest_gap_s']:>15.3f}  {r['tokens_during_prefill']:>21}  {r['long_ttft_s']:>11.3f}"
        )
    print(f"outputs identical: {same}")
    if args.output:
        result = {"model": args.model, "cpu": cpu, "args": vars(args), "rows": rows, "identical": same}
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
