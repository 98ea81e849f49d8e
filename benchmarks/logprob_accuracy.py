"""How far verispec's numbers are from transformers': float32 activations (exact weights, the default) and int8
activations (activation_dtype="int8", llama.cpp's numerics), side by side.

verispec generates greedily (top-5 logprobs per token) once per activation dtype; transformers scores each run's own
prompt + output in float32 and in float64 on the same GGUF weights. Per dtype: top-1 agreement (verispec's greedy
token is transformers' float32 argmax at that position), mean and max |logprob difference| against transformers'
float32 over every top-5 logprob and over the greedy token's alone, the max against float64, and how many greedy outputs equal the float32 run's. The
last row is transformers' own float32 forward against float64 (the scale of float32 rounding). --peer adds
llama.cpp (benchmarks/llama_cpp_peer.py) on the same GGUF and prompt token ids, scored the same way: the deviation of
the numerics int8 mode copies. Writes JSON.
    .venv/bin/python benchmarks/logprob_accuracy.py [--model smollm2-135m-instruct] [--max-tokens 64]
        [--activation-dtypes float32,int8] [--peer]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import llama_cpp_peer
import torch

PROMPTS = [
    "Write a haiku about CPUs.",
    "What is the capital of France?",
    "def fibonacci(n):",
    "Explain speculative decoding in two sentences.",
    "List five prime numbers and explain why they are prime.",
]


# one prompt's greedy output: its tokens and, per token, {token: logprob} of the top-k at that position
Run = list[tuple[list[int], list[dict[int, float]]]]


def score(ref32, ref64, prompts: list[list[int]], run: Run) -> dict:
    """One run's greedy outputs (with top-k logprobs) against transformers' float32 and float64 forwards on the
    same tokens."""
    agree, positions, diffs, chosen, d64, f32_64 = 0, 0, [], [], 0.0, 0.0
    for p, (toks, tops) in zip(prompts, run):
        full = torch.tensor([p + toks])
        with torch.inference_mode():
            # [T, V]
            l32 = torch.log_softmax(ref32(full).logits[0].double(), -1)
            l64 = torch.log_softmax(ref64(full).logits[0], -1)
        for j, top in enumerate(tops):
            # the logits that chose output token j
            pos = len(p) + j - 1
            agree += int(l32[pos].argmax().item() == toks[j])
            positions += 1
            chosen.append(abs(top[toks[j]] - l32[pos, toks[j]].item()))
            for t, v in top.items():
                diffs.append(abs(v - l32[pos, t].item()))
                d64 = max(d64, abs(v - l64[pos, t].item()))
                f32_64 = max(f32_64, abs(l32[pos, t].item() - l64[pos, t].item()))
    return {
        "top1_agree": agree,
        "positions": positions,
        "compared": len(diffs),
        "mean_abs_vs_f32": sum(diffs) / len(diffs),
        "max_abs_vs_f32": max(diffs),
        "greedy_token_mean_abs_vs_f32": sum(chosen) / len(chosen),
        "greedy_token_max_abs_vs_f32": max(chosen),
        "max_abs_vs_f64": d64,
        "transformers_f32_max_abs_vs_f64": f32_64,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--activation-dtypes", default="float32,int8", help="comma list of float32, int8")
    ap.add_argument(
        "--peer",
        action="store_true",
        help="add llama.cpp (llama-cpp-python) on the same GGUF and prompt token ids",
    )
    ap.add_argument("--output", default="bench_results/logprob_accuracy.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from verispec import LLM, SamplingParams
    from verispec.kernels.build import int8_isa
    from verispec.loader.checkpoint import resolve_model_path

    # every prompt gives max_tokens positions (EOS does not stop it): 5 x 64 by default
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=5, ignore_eos=True)
    runs, skipped, prompts = {}, {}, None
    for dtype in args.activation_dtypes.split(","):
        try:
            llm = LLM(args.model, max_model_len=512, max_num_seqs=8, activation_dtype=dtype)
        # int8 on a CPU without VNNI / AMX-INT8, or on weights not kept quantized
        except ValueError as e:
            skipped[dtype] = str(e)
            print(f"activation_dtype={dtype}: skipped ({e})")
            continue
        if prompts is None:
            tok = llm.tokenizer
            prompts = [
                tok.encode(
                    tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False
                )
                for p in PROMPTS
            ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        runs[dtype] = [
            (
                list(o.outputs[0].token_ids),
                [{t: v.logprob for t, v in top.items()} for top in o.outputs[0].logprobs],
            )
            for o in outs
        ]
        del llm
    if not runs:
        raise SystemExit("no activation dtype could run")
    path = resolve_model_path(args.model)
    if args.peer and not llama_cpp_peer.available():
        print("llama.cpp peer skipped: llama-cpp-python is not installed (benchmarks/llama_cpp_peer.py)")
    elif args.peer and path.suffix != ".gguf":
        print("llama.cpp peer skipped: the model is not a GGUF file")
    elif args.peer:
        model = llama_cpp_peer.load(path, torch.get_num_threads(), logits_all=True)
        runs["llama.cpp"] = [llama_cpp_peer.greedy_logprobs(model, p, args.max_tokens, 5) for p in prompts]
        del model
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    where = str(path.parent if kw else path)
    ref32 = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
    ref64 = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float64, **kw).eval()
    first = next(iter(runs.values()))
    rows = {}
    for dtype, outs in runs.items():
        rows[dtype] = score(ref32, ref64, prompts, outs)
        rows[dtype]["same_greedy_as_first"] = sum(a[0] == b[0] for a, b in zip(outs, first))
    isa = int8_isa() if "int8" in runs else None
    print(
        f"model={args.model} prompts={len(prompts)} max_tokens={args.max_tokens} top-5 logprobs per token"
        + (f" int8 kernel={isa}" if isa else "")
    )
    print(
        f"{'activations':<12} {'top-1 agree':>12} {'top-5 mean |d|':>15} {'max':>9} {'greedy mean |d|':>16} "
        f"{'max':>9} {'max |d| f64':>12} {'same greedy':>12}"
    )
    for dtype, r in rows.items():
        print(
            f"{dtype:<12} {r['top1_agree']:>5}/{r['positions']:<6} {r['mean_abs_vs_f32']:>15.2e} "
            f"{r['max_abs_vs_f32']:>9.2e} {r['greedy_token_mean_abs_vs_f32']:>16.2e} "
            f"{r['greedy_token_max_abs_vs_f32']:>9.2e} {r['max_abs_vs_f64']:>12.2e} "
            f"{r['same_greedy_as_first']:>6}/{len(prompts)}"
        )
    f32_64 = max(r["transformers_f32_max_abs_vs_f64"] for r in rows.values())
    print(f"(transformers' own float32 forward against float64: max |d| {f32_64:.2e})")
    print(
        f"|d|: each run's logprobs against transformers' float32 on the same tokens (top-5: all five per "
        f"position; greedy: the chosen token's); same greedy: vs the {next(iter(runs))} run"
    )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps(
            {
                "model": args.model,
                "max_tokens": args.max_tokens,
                "int8_isa": isa,
                "rows": rows,
                "skipped": skipped,
                "transformers_f32_max_abs_vs_f64": f32_64,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
