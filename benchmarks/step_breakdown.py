"""Where a decode step's time goes: plain decoding against speculative configs on one workload, with the engine's
parts timed per call (the target forward, sampling and verification, the proposer, the planner's ask / choose).

    .venv/bin/python benchmarks/step_breakdown.py --workload chat --batch-size 16 --temperature 1 \
        -sc '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}'

Prints the CPU, one row per run (milliseconds per decode step for each part; "prefill" is the prompt steps' time,
"forward" counts prompt chunks too, "decode forward" only the decode steps' own; "other host" is what a decode step
spends outside its forward, sampling, proposer and planner calls) and writes JSON to
bench_results/step_breakdown.json. The timers add a few microseconds per call. With `--device cuda` each
forward's timer waits for the GPU (a synchronisation the engine itself leaves to sampling), so that "decode
forward" holds the GPU's time and not only the launches; the runs' tok/s then include those waits.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch
from adaptive_k import bench_params, cpu_model, device_name, spec_configs

import verispec.engine.engine as engine_module
from verispec.bench import BenchResult, interleaved_round
from verispec.workloads import WORKLOADS, build_workload, chat_prompt_ids

# (part, object attribute path from the engine, method name)
PARTS = (
    ("decode step", "", "_decode"),
    ("prefill", "", "_prefill"),
    ("forward", "", "_forward"),
    ("propose", "proposer", "propose"),
    ("planner ask", "planner", "ask"),
    ("planner choose", "planner", "choose"),
)
# the parts that hold others (a decode step's forward, proposer and planner calls; every step's forward)
WHOLE = ("decode step", "prefill", "forward")


def _timed(obj, name: str, totals: dict, key: str) -> None:
    """Wrap obj.name so that its calls add their seconds to totals[key]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t

    setattr(obj, name, wrapper)


# the totals of the engine whose decode step is running, if one is (sample_step is one module function for every
# engine; prefill's sampling is not counted)
_current: list[dict[str, float] | None] = [None]
# the device whose work a forward's timer waits for (CUDA), or None
_sync: list[torch.device | None] = [None]


def instrument(llm) -> tuple[dict[str, float], dict[str, int]]:
    """Wrap the engine's parts in timers. -> (seconds per part, counts: decode steps)."""
    eng = llm.engine
    totals: dict[str, float] = defaultdict(float)
    for key, path, name in PARTS:
        obj = getattr(eng, path) if path else eng
        if obj is not None:
            _timed(obj, name, totals, key)
    counts: dict[str, int] = defaultdict(int)
    inner_decode, inner_forward = eng._decode, eng._forward

    def counted(reqs):
        counts["steps"] += 1
        _current[0] = totals
        try:
            return inner_decode(reqs)
        finally:
            _current[0] = None

    def forward(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner_forward(*args, **kwargs)
        finally:
            if _sync[0] is not None:
                torch.cuda.synchronize(_sync[0])
            if _current[0] is totals:
                totals["decode forward"] += time.perf_counter() - t

    eng._decode, eng._forward = counted, forward
    return totals, counts


def timed_sample_step(inner):
    """sample_step timed into the decoding engine's totals."""

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if _current[0] is not None:
                _current[0]["sampling"] += time.perf_counter() - t

    return wrapper


def row(res: BenchResult, totals: dict[str, float], counts: dict[str, int]) -> dict:
    steps = max(1, counts["steps"])
    ms = {
        key: totals[key] * 1e3 / steps
        for key in (*WHOLE, "decode forward", "sampling", *[p[0] for p in PARTS if p[0] not in WHOLE])
    }
    # the engine's own host work in a decode step: what its forward, sampling, proposer and planner calls leave
    ms["other host"] = ms["decode step"] - sum(ms[k] for k in ms if k not in WHOLE)
    return asdict(res) | {"decode_steps": counts["steps"], "ms_per_step": ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workload", default="chat", choices=WORKLOADS)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: the batch size")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampled runs are seeded; 0 = greedy")
    ap.add_argument("--speculative-config", "-sc", action="append", default=None, help="JSON; repeatable")
    ap.add_argument("--activation-dtype", default="float32", choices=("float32", "int8"))
    ap.add_argument(
        "--prompts-per-turn",
        type=int,
        default=None,
        help="prompts each engine runs per turn (default: the batch size, one batch in lockstep; more keeps the "
        "slots refilled as requests finish, as a server runs)",
    )
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the model runs")
    ap.add_argument("--output", default="bench_results/step_breakdown.json")
    args = ap.parse_args()
    if args.prompts_per_turn is not None and args.prompts_per_turn < 1:
        ap.error(f"--prompts-per-turn must be >= 1, got {args.prompts_per_turn}")
    from verispec import LLM

    tok = LLM(args.model, max_num_seqs=1, max_model_len=2048).tokenizer
    convs = build_workload(args.workload, args.num_prompts or args.batch_size)
    prompts = chat_prompt_ids(tok, convs)
    sp = bench_params(args.temperature, args.max_tokens)
    specs = spec_configs(ap, args.speculative_config or [], args.model)
    runs = [("plain", None)] + [(s.get("method", str(s.get("model"))), s) for s in specs]
    # the same method twice (two settings): numbered from its second run
    seen: dict[str, int] = defaultdict(int)
    for i, (label, spec) in enumerate(runs):
        seen[label] += 1
        if seen[label] > 1:
            runs[i] = (f"{label} #{seen[label]}", spec)
    kw = dict(
        max_num_seqs=args.batch_size,
        max_model_len=2048,
        activation_dtype=args.activation_dtype,
        device=args.device,
    )
    engines = [(label, LLM(args.model, speculative_config=spec, **kw)) for label, spec in runs]
    device = engines[0][1].device
    _sync[0] = device if device.type == "cuda" else None
    timers_of = {label: instrument(llm) for label, llm in engines}
    sample_step = engine_module.sample_step
    engine_module.sample_step = timed_sample_step(sample_step)
    try:
        timers = interleaved_round(engines, prompts, sp, args.batch_size, args.prompts_per_turn)
    finally:
        engine_module.sample_step = sample_step
    rows = [row(timers[label].result(), *timers_of[label]) for label, _ in engines]
    print(f"CPU: {cpu_model()}, threads={torch.get_num_threads()}, {device_name(args.device)}")
    print(
        f"model={args.model} workload={args.workload} batch={args.batch_size} prompts={len(prompts)} "
        f"max_tokens={args.max_tokens} temperature={args.temperature} activation_dtype={args.activation_dtype}"
    )
    keys = list(rows[0]["ms_per_step"])
    head = f"{'run':<12}{'tok/s':>8}{'steps':>7}" + "".join(f"{k:>16}" for k in keys)
    print("ms per decode step\n" + head + "\n" + "-" * len(head))
    for r in rows:
        cells = "".join(f"{r['ms_per_step'][k]:>16.3f}" for k in keys)
        print(f"{r['label']:<12}{r['tok_per_s']:>8.1f}{r['decode_steps']:>7}" + cells)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"cpu": cpu_model(), "device": device_name(args.device), "args": vars(args), "rows": rows},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
