"""Drafts accepted per verification step: token-level (Leviathan) vs Block Verify vs Entropy Verify, by K.

A target and a draft are Markov chains over a small vocabulary (the next token's law depends on the previous token;
the draft is a deliberately imperfect copy of the target). Many sequences are generated step by step through
`verispec.sample.verify.rejection_sample`, exactly as the engine verifies, so the figures isolate the verifier: the
same drafts, the same target, only the acceptance rule differs. Drafts are either sampled from the draft chain (q
kept) or its argmax (one-hot q, as n-gram, suffix and the model-based drafters here give them).

    .venv/bin/python benchmarks/verify_acceptance.py [--ks 2,4,6] [--sequences 4000] [--length 64]

Prints one table and writes JSON to bench_results/verify_acceptance.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from verispec.sample.verify import entropy_thresholds, rejection_sample

V = 16


def chains(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(target [V, V], draft [V, V]): row i is the next-token law after token i."""
    g = torch.Generator().manual_seed(seed)
    target = (torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5).softmax(-1)
    draft = (target.log() + torch.randn(V, V, generator=g, dtype=torch.float64) * 0.8).softmax(-1)
    return target, draft


def accepted_per_step(k: int, mode: str, sampled_drafts: bool, n: int, length: int, seed: int = 1) -> float:
    target, draft = chains()
    g = torch.Generator().manual_seed(seed)
    last = torch.zeros(n, dtype=torch.long)
    count = torch.zeros(n, dtype=torch.long)
    steps = accepted = 0
    while (count < length).any():
        drafts, ctx = [], last
        for _ in range(k):
            ctx = (
                torch.multinomial(draft[ctx], 1, generator=g).squeeze(1)
                if sampled_drafts
                else draft[ctx].argmax(-1)
            )
            drafts.append(ctx)
        # [n, k]
        d = torch.stack(drafts, 1)
        # [n, k + 1]
        contexts = torch.cat([last[:, None], d], 1)
        # [n, k + 1, V]
        p = target[contexts]
        res, na = rejection_sample(
            "probabilistic",
            d,
            p,
            draft_probs=draft[contexts[:, :k]] if sampled_drafts else None,
            uniform_samples=torch.rand(n, k, generator=g, dtype=torch.float64),
            sample_u=torch.rand(n, k + 1, generator=g, dtype=torch.float64),
            block=mode == "block",
            thresholds=entropy_thresholds(p[:, :k], 0.95, 0.4) if mode == "entropy" else None,
        )
        short = count < length
        steps, accepted = steps + int(short.sum()), accepted + int(na[short].sum())
        last = res.gather(1, na[:, None]).squeeze(1)
        count += na + 1
    return accepted / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--sequences", type=int, default=4000)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--output", default="bench_results/verify_acceptance.json")
    args = ap.parse_args()
    rows = []
    print(
        f"vocab={V} sequences={args.sequences} length={args.length} (accepted drafts per verification step)"
    )
    print(f"{'drafts':>12} {'K':>3} {'token-level':>12} {'block':>8} {'x':>6} {'entropy*':>9}")
    for sampled in (True, False):
        for k in (int(x) for x in args.ks.split(",")):
            r = {"drafts": "sampled q" if sampled else "argmax", "k": k}
            for mode in ("token", "block", "entropy"):
                r[mode] = accepted_per_step(k, mode, sampled, args.sequences, args.length)
            rows.append(r)
            print(
                f"{r['drafts']:>12} {k:>3} {r['token']:>12.3f} {r['block']:>8.3f} {r['block'] / r['token']:>5.2f}x "
                f"{r['entropy']:>9.3f}"
            )
    print(
        "* Entropy Verify (posterior_threshold 0.95, posterior_alpha 0.4) is not lossless: more accepted drafts, "
        "a different output law"
    )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps({"vocab": V, "sequences": args.sequences, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
