"""The goodput planner against fixed draft lengths, side by side in one run: for every cell (workload x batch size x
temperature) and speculative config, plain decoding, the planner (the default) and each fixed K of the sweep
(enable_adaptive_verification false).

    .venv/bin/python benchmarks/adaptive_k.py --workloads code-edit,chat,repeat-edit --batch-sizes 1,16 \
        --temperatures 0,1 --fixed-k 1,2,4,8 \
        -sc '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}' \
        -sc '{"method": "suffix"}'

`--repeats N` runs every variant of a cell N rounds in turn (a fresh engine each time; each round starts at
another variant) and reports each one's median round, so that the machine's drift and a place in the round fall
on every variant alike; the ratios to plain are medians over rounds of the ratio within a round. `--interleave`
pairs the variants closer still: a round builds every variant's engine first, then runs the prompts a batch at a
time on each engine in turn, so that a slow spell of the machine (seconds long on a shared VM) falls on all of
them instead of on one whole run. A batch run alone goes in lockstep to its longest request (sampled runs ignore
EOS: every request to max_tokens), so drafts that speed up only some of its requests cannot shorten it;
`--prompts-per-turn N` (N > batch) gives each engine N prompts per turn and keeps its slots refilled as requests
finish, as a server at that concurrency runs. `--keep-engines` (with `--interleave`) builds each variant's engine
once per cell and runs every round on it: from the second round on, suffix decoding's global tree holds the
answers of the rounds before (a server asked the same or similar tasks again, as agents do), the regime where
whole answers are recalled and almost every draft is accepted.

Prints the CPU, one line per run and a summary per cell (planner / plain, best fixed K / plain, planner / best
fixed K, and the ceiling that plain's share of prompt processing puts on any method end to end); writes JSON to
bench_results/adaptive_k.json. Every run also counts its outputs identical to plain's (sampled runs too: under
strict verification, the default, a seeded request's sampled text does not change).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from verispec.bench import BenchResult, interleaved_round, prompt_ceiling, time_llm
from verispec.sampling_params import SamplingParams
from verispec.workloads import WORKLOADS, build_workload, chat_prompt_ids


def device_name(device: str) -> str:
    """Where the model runs, in words: the GPU's name on CUDA (auto picks CUDA where there is one), else "CPU"."""
    if device != "cpu" and torch.cuda.is_available():
        return f"GPU: {torch.cuda.get_device_name()}"
    return "on the CPU"


def bench_params(temperature: float, max_tokens: int) -> SamplingParams:
    """The benchmarks' sampling: seeded when sampled, and sampled runs ignore EOS so that every variant emits the
    same number of tokens even under a rule whose output differs from plain's (probabilistic); under strict
    verification every output is plain's."""
    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        seed=0 if temperature else None,
        ignore_eos=bool(temperature),
    )


def spec_configs(ap: argparse.ArgumentParser, texts: list[str], model: str) -> list[dict]:
    """The --speculative-config arguments as dicts, each checked as the engine will check it; a bad one ends the run
    with the parser's usage error (exit 2) naming the key, before any model runs."""
    from verispec.proposers.factory import resolve_speculative_config

    out = []
    for text in texts:
        try:
            spec = json.loads(text)
            resolve_speculative_config(spec, 2048, target_model=model)
        except ValueError as e:
            ap.error(f"--speculative-config {text}: {e}")
        out.append(spec)
    return out


def cpu_model() -> str:
    """The CPU's model name and the vector extensions that decide kernel speed (AVX2, AVX-512, VNNI, AMX)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return f"{name} ({', '.join(f for f in wanted if f in flags) or 'no AVX2'})"


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def spec_names(specs: list[dict]) -> list[str]:
    """Each config's label: its method, numbered from the second config of the same method on ("draft_model #2")."""
    names: list[str] = []
    for spec in specs:
        name = spec.get("method", str(spec.get("model")))
        seen = sum(n.split(" #")[0] == name for n in names)
        names.append(f"{name} #{seen + 1}" if seen else name)
    return names


def variants(spec: dict, fixed: list[int], name: str) -> list[tuple[str, dict]]:
    """The planner run of `spec` (labelled `name`), then one fixed-K run per K of the sweep."""
    out = [(f"{name} planner", spec | {"enable_adaptive_verification": True})]
    for k in fixed:
        out.append(
            (f"{name} K={k}", spec | {"num_speculative_tokens": k, "enable_adaptive_verification": False})
        )
    return out


def run_cell(args, workload: str, batch: int, temperature: float, specs: list[dict]) -> dict:
    """Every variant of the cell, `args.repeats` rounds in turn (each run on a freshly built engine, so suffix
    decoding's global tree never carries over); a label's row is its median run by tok/s."""
    from verispec import LLM

    kw = dict(
        max_num_seqs=batch, max_model_len=2048, activation_dtype=args.activation_dtype, device=args.device
    )
    plain = LLM(args.model, **kw)
    tok = plain.tokenizer
    num = max(args.num_prompts, batch)
    convs = build_workload(workload, num)
    prompts = chat_prompt_ids(tok, convs)
    sp = bench_params(temperature, args.max_tokens)
    configs = [("plain", None)] + [
        v for spec, name in zip(specs, spec_names(specs)) for v in variants(spec, args.fixed_k, name)
    ]
    rounds: dict[str, list[dict]] = {label: [] for label, _ in configs}
    texts: dict[str, list] = {}

    def record(label: str, llm, res: BenchResult, outs: list) -> None:
        ids = [o.outputs[0].token_ids for o in outs]
        texts.setdefault(label, ids)
        rounds[label].append(asdict(res) | {"ids": ids, "mean_chosen_k": llm.engine.counters.mean_chosen_k})

    kept: dict[str, object] = {}

    def build(label: str, config: dict | None):
        # every run on a fresh engine, plain too: a fresh engine's first run is slower (see time_llm), and
        # reusing plain's would favour it from the second round on (with --keep-engines every variant's is reused)
        if args.keep_engines and label in kept:
            return kept[label]
        llm = _fresh(config)
        if args.keep_engines:
            kept[label] = llm
        return llm

    def _fresh(config: dict | None):
        nonlocal plain
        if config is None:
            # the tokenizer's engine serves plain's first run
            llm, plain = plain or LLM(args.model, **kw), None
            return llm
        return LLM(args.model, speculative_config=config, **kw)

    for i in range(args.repeats):
        # each round starts at a different variant, so that a place in the round (after a slow run, late in a
        # long one) falls on every variant alike
        shift = i * len(configs) // args.repeats
        order = configs[shift:] + configs[:shift]
        if args.interleave:
            timers = interleaved_round(
                [(label, build(label, config)) for label, config in order],
                prompts,
                sp,
                batch,
                args.prompts_per_turn,
            )
            for label, timer in timers.items():
                record(label, timer.llm, timer.result(), timer.outs)
            # the round's engines' memory back before the next round builds its own
            del timers, timer
            gc.collect()
            continue
        for label, config in order:
            llm = build(label, config)
            res, outs = time_llm(llm, prompts, sp, label, batch=batch)
            record(label, llm, res, outs)
            # the old engine's memory back before the next one is built
            del llm, outs
            gc.collect()
    runs = []
    for rows in rounds.values():
        for r in rows:
            r["identical"] = sum(a == b for a, b in zip(r.pop("ids"), texts["plain"]))
        ranked = sorted(rows, key=lambda r: r["tok_per_s"])
        # against plain's run of the same round: the machine's drift between rounds falls on both alike
        ratios = [r["tok_per_s"] / p["tok_per_s"] for r, p in zip(rows, rounds["plain"])]
        runs.append(
            ranked[len(ranked) // 2]
            | {
                "rounds_tok_per_s": [r["tok_per_s"] for r in rows],
                "rounds_ratio_to_plain": ratios,
                "ratio_to_plain": statistics.median(ratios),
            }
        )
    return {"workload": workload, "batch_size": batch, "temperature": temperature, "runs": runs}


def summarize(cell: dict, specs: list[dict]) -> list[str]:
    """One line per config: planner / plain and best fixed K / plain (medians over rounds of the ratio within a
    round), planner / best fixed K (the median over rounds of the two runs' ratio), the planner's mean K and the
    cell's ceiling (1 / plain's share of prompt processing: no speculative method beats it end to end)."""
    runs = {r["label"]: r for r in cell["runs"]}
    plain = runs["plain"]
    bound = prompt_ceiling(BenchResult(**{f.name: plain[f.name] for f in fields(BenchResult)}))
    ceiling = f"{bound[1]:>9.2f}x" if bound else f"{'-':>10}"
    lines = []
    for name in spec_names(specs):
        planner = runs[f"{name} planner"]
        fixed = [r for label, r in runs.items() if label.startswith(f"{name} K=")]
        best = max(fixed, key=lambda r: r["ratio_to_plain"]) if fixed else None
        text = (
            f"{cell['workload']:<12}{cell['batch_size']:>6}{cell['temperature']:>6.1f}  {name:<16}"
            f"{planner['ratio_to_plain']:>9.2f}x"
        )
        if best is not None:
            vs_best = statistics.median(
                a / b for a, b in zip(planner["rounds_tok_per_s"], best["rounds_tok_per_s"])
            )
            text += f"{best['ratio_to_plain']:>9.2f}x {best['label'].split('=')[-1]:>3}{vs_best:>11.2f}x"
        lines.append(text + f"{planner.get('mean_chosen_k') or 0:>9.2f}{ceiling}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workloads", default="code-edit,chat,repeat-edit")
    ap.add_argument("--batch-sizes", type=int_list, default=[1, 16])
    ap.add_argument("--temperatures", type=_floats, default=[0.0, 1.0])
    ap.add_argument("--fixed-k", type=int_list, default=[1, 2, 4, 8], help="fixed draft lengths to compare")
    ap.add_argument("--num-prompts", type=int, default=8, help="per cell (at least the batch size)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="rounds per cell; each row is the median round")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="keep a round's engines alive together and run the prompts batch by batch on each in turn (memory: "
        "one engine per variant)",
    )
    ap.add_argument(
        "--keep-engines",
        action="store_true",
        help="with --interleave: one engine per variant for all of a cell's rounds (suffix decoding's global tree "
        "keeps the rounds' answers: repeated tasks)",
    )
    ap.add_argument(
        "--prompts-per-turn",
        type=int,
        default=None,
        help="with --interleave: prompts each engine runs per turn (default: the batch size, one batch in lockstep "
        "to its longest request); more keeps the batch's slots refilled as requests finish, as a server at that "
        "concurrency runs",
    )
    ap.add_argument("--activation-dtype", default="float32", choices=("float32", "int8"))
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the model runs")
    ap.add_argument("--speculative-config", "-sc", action="append", default=None, help="JSON; repeatable")
    ap.add_argument("--output", default="bench_results/adaptive_k.json")
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown workload {w!r}; allowed: {', '.join(WORKLOADS)}")
    specs = spec_configs(
        ap,
        args.speculative_config
        or ['{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}'],
        args.model,
    )
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.prompts_per_turn is not None and args.prompts_per_turn < 1:
        ap.error(f"--prompts-per-turn must be >= 1, got {args.prompts_per_turn}")
    if args.keep_engines and not args.interleave:
        ap.error("--keep-engines needs --interleave (one engine per variant, alive together)")
    started = time.time()
    cells = []
    for w in workloads:
        for b in args.batch_sizes:
            for t in args.temperatures:
                cell = run_cell(args, w, b, t, specs)
                cells.append(cell)
                for r in cell["runs"]:
                    same = "" if r["identical"] is None else f"  identical {r['identical']}"
                    spread = "/".join(f"{x:.0f}" for x in r["rounds_tok_per_s"])
                    print(
                        f"[{w} b={b} T={t}] {r['label']:<20}{r['tok_per_s']:>8.1f} tok/s  "
                        f"mean AL {r['mean_acceptance_length']:.2f}{same}  rounds {spread}",
                        flush=True,
                    )
    setup = (
        f"model={args.model}, max_tokens={args.max_tokens}, activation_dtype={args.activation_dtype}, "
        f"repeats={args.repeats} (median)"
    )
    if args.interleave and args.prompts_per_turn:
        setup += f", prompts per turn {args.prompts_per_turn}"
    print(f"\nCPU: {cpu_model()}, threads={torch.get_num_threads()}, {device_name(args.device)}, {setup}")
    head = (
        f"{'workload':<12}{'batch':>6}{'T':>6}  {'method':<16}{'planner':>10}{'best K':>10}{'K':>4}"
        f"{'plan/best':>12}{'mean K':>9}{'ceiling':>10}"
    )
    print(head + "\n" + "-" * len(head))
    for cell in cells:
        print("\n".join(summarize(cell, specs)))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "cpu": cpu_model(),
                "device": device_name(args.device),
                "args": vars(args),
                "seconds": time.time() - started,
                "cells": cells,
            }
        )
    )


if __name__ == "__main__":
    main()
