"""Speculation priced by a fixed cost model: what the planner's choices are worth, without the machine's timing noise.

On a shared VM two runs of the same batch can differ by 10-30% in wall time, far more than what separates two
planner policies. Here every run records the rows and sequences of each decode step; a step over n rows of q
sequences is priced at profile(n) + (q - 1) * seq_extra + overhead, and a config's modeled speedup is plain
decoding's priced time over its own. profile is one careful timing of the target's forward per row count on this
machine (best of many rounds, taken once at the start, pooled monotone as the engine's own profile), seq_extra what
each sequence of a batch step adds beyond its row (its own keys and values: the profile's batch step), and the
planner of every run plans with that same profile (its online fit still follows the real step timings). overhead is
what a step costs beyond both (sampling, committing, contexts longer than the profile's): the first plain run's
measured decode-step time less its priced forward, averaged over its steps. Drafting and planning host time are not priced: `step_breakdown.py` times them.

    .venv/bin/python benchmarks/modeled_speedup.py --workloads code-edit,chat,repeat-edit --temperatures 0,1 \
        --batch-size 16 --activation-dtype int8 \
        -sc '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}' -sc '{"method": "suffix"}'

Prints the CPU and a table (modeled speedup per cell: the median over rounds, and every round) and writes JSON to
bench_results/modeled_speedup.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from adaptive_k import bench_params, cpu_model, spec_configs

import verispec.engine.builder as builder
import verispec.planner.step_cost as step_cost
from verispec.planner.step_cost import StepCostModel, profile_batch_step, profile_points, profile_step_cost
from verispec.workloads import WORKLOADS, build_workload, chat_prompt_ids


def record_steps(llm) -> list[list]:
    """Wrap the engine's decode step: each appends [rows its forward scored, its sequences, its seconds]."""
    eng, steps = llm.engine, []
    inner_decode, inner_forward = eng._decode, eng._forward

    def decode(reqs):
        steps.append([0, 0, 0.0])
        t = time.perf_counter()
        out = inner_decode(reqs)
        steps[-1][2] = time.perf_counter() - t
        return out

    def forward(reqs, rows):
        if steps and not any(r.in_prefill for r in reqs):
            steps[-1][:2] = sum(len(r.token_ids) for r in rows), len(rows)
        return inner_forward(reqs, rows)

    eng._decode, eng._forward = decode, forward
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workloads", default="code-edit,chat,repeat-edit")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--speculative-config", "-sc", action="append", default=None, help="JSON; repeatable")
    ap.add_argument("--activation-dtype", default="float32", choices=("float32", "int8"))
    ap.add_argument(
        "--profile",
        default=None,
        help="price with the profile (and step overhead) of an earlier run's JSON instead of measuring them: runs on "
        "two checkouts then share one reference",
    )
    ap.add_argument("--output", default="bench_results/modeled_speedup.json")
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or args.rounds < 1 or args.batch_size < 1:
        ap.error(f"--workloads from {WORKLOADS}, --rounds and --batch-size >= 1 (got {bad or ''})")
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    specs = spec_configs(ap, args.speculative_config or [], args.model)
    from verispec import LLM

    kw = dict(max_num_seqs=args.batch_size, max_model_len=2048, activation_dtype=args.activation_dtype)
    overhead = None
    if args.profile:
        try:
            saved = json.loads(Path(args.profile).read_text())
            profile = {int(r): float(t) for r, t in saved["profile"].items()}
            overhead = float(saved["step_overhead_s"])
            # (an earlier run's JSON may have no batch step)
            batch = saved.get("batch")
            batch = None if batch is None else (int(batch[0]), float(batch[1]))
            StepCostModel(profile, batch)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            ap.error(f"--profile {args.profile}: not a modeled_speedup.py JSON with a profile ({e!r})")
    ref = LLM(args.model, **kw)
    if not args.profile:
        # one careful profile up to the most rows a step may score (every config's cap, on the full batch)
        points = profile_points(25, min(args.batch_size * 26, 256), args.batch_size)
        step_cost._PROFILE_BUDGET_S = 20.0
        profile = profile_step_cost(ref.engine.runner, ref.engine.cache.allocate(), points, repeats=12)
        batch = None
        if args.batch_size > 1:
            slots = list(range(min(args.batch_size, ref.engine.cache.num_slots, builder._BATCH_PROFILE_SEQS)))
            batch = profile_batch_step(ref.engine.runner, slots, repeats=12)
    model = StepCostModel(profile, batch)
    # every planner plans with this profile
    builder.load_or_profile = lambda *a, **k: (StepCostModel(profile, batch), True)
    tok = ref.tokenizer
    del ref
    runs = [("plain", None)] + [(s.get("method", str(s.get("model"))), s) for s in specs]
    rows = []
    for workload in workloads:
        convs = build_workload(workload, args.batch_size)
        prompts = [{"prompt_token_ids": ids} for ids in chat_prompt_ids(tok, convs)]
        for temperature in temperatures:
            sp = bench_params(temperature, args.max_tokens)
            priced: dict[str, list[float]] = {label: [] for label, _ in runs}
            steps_of: dict[str, list[int]] = {label: [] for label, _ in runs}
            for _ in range(args.rounds):
                for label, spec in runs:
                    llm = LLM(args.model, speculative_config=spec, **kw)
                    steps = record_steps(llm)
                    llm.generate(prompts, sp, use_tqdm=False)
                    # each step's rows, and each of its sequences after the first (its own keys and values)
                    forward = sum(model.profiled(n) + (q - 1) * model.seq_extra for n, q, _ in steps)
                    if overhead is None and spec is None:
                        # the per-step time the profile leaves out, from the first plain run
                        overhead = max(0.0, (sum(s for _, _, s in steps) - forward) / len(steps))
                    priced[label].append(forward + len(steps) * overhead)
                    steps_of[label].append(len(steps))
            plain = statistics.median(priced["plain"])
            for label, _ in runs[1:]:
                ratios = [plain / t for t in priced[label]]
                rows.append(
                    {
                        "workload": workload,
                        "temperature": temperature,
                        "method": label,
                        "modeled_speedup": statistics.median(ratios),
                        "rounds": ratios,
                        "decode_steps": statistics.median(steps_of[label]),
                        "plain_decode_steps": statistics.median(steps_of["plain"]),
                    }
                )
    print(f"CPU: {cpu_model()}, threads={torch.get_num_threads()}")
    print(
        f"model={args.model} batch={args.batch_size} max_tokens={args.max_tokens} activation_dtype="
        f"{args.activation_dtype} rounds={args.rounds} profile(B)={model.profiled(args.batch_size) * 1e3:.2f} ms "
        f"profile(B+4)={model.profiled(args.batch_size + 4) * 1e3:.2f} ms step overhead={overhead * 1e3:.2f} ms"
    )
    head = f"{'workload':<12}{'T':>5}  {'method':<10}{'modeled':>9}  {'steps':>11}  rounds"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        steps = f"{r['decode_steps']:.0f}/{r['plain_decode_steps']:.0f}"
        each = " ".join(f"{x:.3f}" for x in r["rounds"])
        print(
            f"{r['workload']:<12}{r['temperature']:>5.1f}  {r['method']:<10}{r['modeled_speedup']:>8.3f}x  "
            f"{steps:>11}  {each}"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "cpu": cpu_model(),
        "args": vars(args),
        "profile": profile,
        "batch": batch,
        "step_overhead_s": overhead,
    }
    out.write_text(json.dumps(meta | {"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
