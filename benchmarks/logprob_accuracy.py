"""How far verispec's numbers are from exact: its top-k logprobs against a float64 transformers forward.

verispec generates greedily (top-5 logprobs per token); transformers scores the same prompt + output in float32 and in
float64 on the same GGUF weights. Prints the largest |logprob difference| of verispec and of transformers' float32
forward against float64 (the scale of float32 rounding), and writes JSON.
    .venv/bin/python benchmarks/logprob_accuracy.py [--model smollm2-135m-instruct] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PROMPTS = [
    "Write a haiku about CPUs.",
    "What is the capital of France?",
    "def fibonacci(n):",
    "Explain speculative decoding in two sentences.",
    "List five prime numbers and explain why they are prime.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--output", default="bench_results/logprob_accuracy.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from verispec import LLM, SamplingParams
    from verispec.loader.checkpoint import resolve_model_path

    llm = LLM(args.model, max_model_len=512, max_num_seqs=8)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    path = resolve_model_path(args.model)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    where = str(path.parent if kw else path)
    ref32 = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
    ref64 = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float64, **kw).eval()
    ours, f32, n = 0.0, 0.0, 0
    for p, o in zip(prompts, outs):
        full = torch.tensor([p + list(o.outputs[0].token_ids)])
        with torch.inference_mode():
            l32 = torch.log_softmax(ref32(full).logits[0].double(), -1)
            l64 = torch.log_softmax(ref64(full).logits[0], -1)
        for j, top in enumerate(o.outputs[0].logprobs):
            pos = len(p) + j - 1  # the logits that chose output token j
            for t, v in top.items():
                ours = max(ours, abs(v.logprob - l64[pos, t].item()))
                f32 = max(f32, abs(l32[pos, t].item() - l64[pos, t].item()))
                n += 1
    print(f"model={args.model} prompts={len(prompts)} max_tokens={args.max_tokens} logprobs compared={n}")
    print(f"largest |logprob - float64|: verispec {ours:.2e}, transformers float32 {f32:.2e}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"model": args.model, "compared": n, "verispec_max_abs": ours,
                                             "transformers_f32_max_abs": f32}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
