"""Prompt processing on a long code prompt: verispec (float32 and int8 activations) beside llama.cpp.

    python benchmarks/prompt_speed.py --model qwen2.5-coder-1.5b-instruct --prompt-tokens 900

The prompt is the first --prompt-tokens tokens of a source file of this repository (real code), the same token ids
to every engine; one output token; median of --repeats. llama.cpp runs if llama-cpp-python is installed
(benchmarks/llama_cpp_peer.py), timing its `eval` of the ids; --peer-extra-buffers gives it its default extra
buffer types (on an AMX CPU: its AMX-INT8 kernels for Q4_K / Q6_K / Q8_0 weights; with llama-cpp-python 0.3.36 they
die with SIGSEGV on Qwen2.5-Coder-1.5B Q4_K_M as on SmolLM2, so the peer's default stays off).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llama_cpp_peer
from adaptive_k import cpu_model

from verispec import LLM, SamplingParams
from verispec.loader.checkpoint import resolve_model_path

SOURCE = Path(__file__).resolve().parents[1] / "verispec" / "engine" / "engine.py"


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--peer-extra-buffers",
        action="store_true",
        help="llama.cpp with its extra buffer types (its AMX repacking on AMX CPUs, llama.cpp's default; "
        "llama_cpp_peer.py turns them off by default)",
    )
    ap.add_argument("--output", help="JSON file for the results")
    args = ap.parse_args()
    llama_cpp_peer.EXTRA_BUFFERS = args.peer_extra_buffers
    rows, ids = [], None
    sp = SamplingParams(temperature=0, max_tokens=1)
    for dtype in ("float32", "int8"):
        llm = LLM(
            args.model,
            max_model_len=2048,
            max_num_seqs=1,
            activation_dtype=dtype,
            threads=args.threads,
            # the same prompt every repeat: its processing, not a cache hit
            enable_prefix_caching=False,
        )
        ids = ids or llm.tokenizer.encode(SOURCE.read_text(), add_special_tokens=False)[: args.prompt_tokens]
        llm.generate([{"prompt_token_ids": ids[:64]}], sp, use_tqdm=False)
        prompt = [{"prompt_token_ids": ids}]
        s = timed(lambda llm=llm, prompt=prompt: llm.generate(prompt, sp, use_tqdm=False), args.repeats)
        rows.append({"engine": f"verispec {dtype}", "tok_s": len(ids) / s})
    if llama_cpp_peer.available():
        peer = llama_cpp_peer.load(resolve_model_path(args.model), args.threads, n_ctx=2048)

        def run():
            peer.reset()
            peer.eval(ids)

        name = "llama.cpp" + (" (extra buffers)" if args.peer_extra_buffers else "")
        rows.append({"engine": name, "tok_s": len(ids) / timed(run, args.repeats)})
    print(f"\n{args.model}, a {len(ids)}-token prompt, {args.threads} threads; CPU: {cpu_model()}")
    print("| engine | prompt tok/s |\n| --- | --- |")
    for r in rows:
        print(f"| {r['engine']} | {r['tok_s']:.0f} |")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": args.model, "cpu": cpu_model(), "prompt_tokens": len(ids), "threads": args.threads}
        Path(args.output).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
