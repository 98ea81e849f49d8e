"""`verispec bench`: the same prompts with and without speculation, in one process, side by side."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from verispec import LLM
from verispec.engine.args import EngineArgs
from verispec.plot import check_plot_path, plot_spec_decode
from verispec.proposers.factory import resolve_speculative_config
from verispec.sampling_params import SamplingParams
from verispec.workloads import build_workload, chat_prompt_ids


@dataclass
class BenchResult:
    label: str
    seconds: float
    output_tokens: int
    tok_per_s: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_acceptance_length: float = 1.0
    per_position: list[float] = field(default_factory=list)
    # time in prompt-processing steps
    prefill_seconds: float = 0.0
    # tokens from decode steps / time in decode steps (prefill excluded)
    decode_tok_per_s: float = 0.0
    # prompt tokens found in the prefix cache / prompt tokens looked up (0 with the cache off)
    prefix_hit_rate: float = 0.0


class RunTimer:
    """One engine's timed generate calls summed into one BenchResult (wall time of the calls, the engine's counters
    across them), so that runs of several engines can take turns prompt by prompt."""

    def __init__(self, llm, label: str):
        self.llm, self.label = llm, label
        self.seconds = 0.0
        self.outs: list = []
        c = llm.engine.counters
        self._c0 = (
            c.prefill_seconds,
            c.decode_seconds,
            c.decode_tokens,
            c.prefix_cache_queries,
            c.prefix_cache_hits,
        )
        s = c.spec
        self._s0 = (
            (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.num_accepted_tokens_per_pos))
            if s
            else None
        )

    def generate(self, prompts: list[list[int]], sp: SamplingParams, progress: bool = False) -> list:
        """The prompts from a cold prefix cache: a workload's own reuse counts, nothing from warm-ups or from
        earlier calls (the same prompts again would otherwise skip their prompt processing)."""
        self.llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=progress)
        self.seconds += time.perf_counter() - t
        self.outs += outs
        return outs

    def result(self) -> BenchResult:
        dt, c = self.seconds, self.llm.engine.counters
        n = sum(len(o.outputs[0].token_ids) for o in self.outs)
        res = BenchResult(self.label, dt, n, n / dt)
        res.prefill_seconds = c.prefill_seconds - self._c0[0]
        res.decode_tok_per_s = (c.decode_tokens - self._c0[2]) / max(1e-9, c.decode_seconds - self._c0[1])
        queries = c.prefix_cache_queries - self._c0[3]
        res.prefix_hit_rate = (c.prefix_cache_hits - self._c0[4]) / queries if queries else 0.0
        s, base = c.spec, self._s0
        if s is not None:
            res.num_drafts = s.num_drafts - base[0]
            res.num_draft_tokens = s.num_draft_tokens - base[1]
            res.num_accepted_tokens = s.num_accepted_tokens - base[2]
            per = [a - b for a, b in zip(s.num_accepted_tokens_per_pos, base[3])]
            res.mean_acceptance_length = 1 + res.num_accepted_tokens / max(1, res.num_drafts)
            res.per_position = [round(x / max(1, res.num_drafts), 3) for x in per]
        return res


def warm_up(llm, prompt: list[int], batch: int = 1) -> None:
    """`batch` copies of a prompt for a few tokens: a fresh engine's first run at a batch size it has not seen is
    slower, which would fall on whichever engine was built last."""
    llm.generate([{"prompt_token_ids": prompt}] * max(1, batch), SamplingParams(max_tokens=4), use_tqdm=False)


def time_llm(
    llm, prompts: list[list[int]], sp: SamplingParams, label: str, progress: bool = False, batch: int = 1
) -> tuple[BenchResult, list]:
    """One timed run of every prompt after a warm-up; `progress` draws a tqdm bar on stderr (one update per
    finished prompt)."""
    warm_up(llm, prompts[0], min(batch, len(prompts)))
    timer = RunTimer(llm, label)
    outs = timer.generate(prompts, sp, progress)
    return timer.result(), outs


def interleaved_round(
    engines: list[tuple[str, object]],
    prompts: list[list[int]],
    sp: SamplingParams,
    batch: int,
    per_turn: int | None = None,
) -> dict[str, RunTimer]:
    """One round with every variant's engine alive: the prompts `per_turn` (default `batch`) at a time, each chunk
    run by every engine in turn (the order rotating from chunk to chunk), so that a slow spell of the machine falls
    on every variant of the round alike instead of on whichever whole run it met. A chunk larger than the engines'
    batch keeps their slots refilled as requests finish (continuous batching, as a server at that concurrency
    runs); a chunk of one batch runs it in lockstep to its longest request. -> {label: RunTimer}"""
    labels = [label for label, _ in engines]
    if len(set(labels)) != len(labels):
        raise ValueError(f"interleaved_round needs a distinct label per engine, got {labels}")
    for _, llm in engines:
        warm_up(llm, prompts[0], min(batch, len(prompts)))
    timers = {label: RunTimer(llm, label) for label, llm in engines}
    step = per_turn or batch
    if step < 1:
        raise ValueError(f"interleaved_round: per_turn and batch must be >= 1, got {per_turn} and {batch}")
    chunks = [prompts[i : i + step] for i in range(0, len(prompts), step)]
    for j, chunk in enumerate(chunks):
        turn = j % len(engines)
        for label, _ in engines[turn:] + engines[:turn]:
            timers[label].generate(chunk, sp)
    return timers


def _opt(v: float, fmt: str, width: int) -> str:
    """A number, or '-' where the run has none (a peer engine does not report prefill / decode split)."""
    return f"{v:>{width}{fmt}}" if v else f"{'-':>{width}}"


def prompt_ceiling(baseline: BenchResult) -> tuple[float, float] | None:
    """(share of the plain run spent in prompt processing, the end-to-end speedup speculation could reach if decoding
    took no time at all): speculation only shortens decode steps, so 1 / share bounds every method on this workload.
    None when the run has no timed prompt steps."""
    if baseline.prefill_seconds <= 0 or baseline.seconds <= 0:
        return None
    share = min(1.0, baseline.prefill_seconds / baseline.seconds)
    return share, 1.0 / share


def print_table(rows: list[BenchResult], baseline: BenchResult) -> None:
    head = f"{'run':<28}{'out tok':>8}{'tok/s':>9}{'speedup':>9}{'prefill s':>10}{'decode tok/s':>13}{'speedup':>9}{'drafts':>8}{'drafted':>9}{'accepted':>9}{'mean AL':>8}  per-position"
    print(head)
    print("-" * len(head))
    hits = [f"{r.label} {r.prefix_hit_rate:.0%}" for r in rows]
    for r in rows:
        print(
            f"{r.label:<28}{r.output_tokens:>8}{r.tok_per_s:>9.1f}{r.tok_per_s / baseline.tok_per_s:>8.2f}x"
            f"{_opt(r.prefill_seconds, '.2f', 10)}{_opt(r.decode_tok_per_s, '.1f', 13)}"
            f"{_opt(r.decode_tok_per_s / baseline.decode_tok_per_s if baseline.decode_tok_per_s else 0, '.2f', 8)}"
            f"{'x' if r.decode_tok_per_s and baseline.decode_tok_per_s else ' '}"
            f"{r.num_drafts:>8}{r.num_draft_tokens:>9}{r.num_accepted_tokens:>9}{r.mean_acceptance_length:>8.2f}  "
            f"{', '.join(f'{x:.2f}' for x in r.per_position)}"
        )
    print(f"prefix cache hit rate: {', '.join(hits)}")
    bound = prompt_ceiling(baseline)
    if bound is not None:
        print(
            f"prompt processing is {bound[0]:.0%} of the plain run: speculation can speed this workload up "
            f"{bound[1]:.2f}x at most end to end (it shortens decode steps only)"
        )


def run_bench(
    engine: EngineArgs,
    workload: str,
    num_prompts: int,
    batch_size: int,
    max_tokens: int,
    output: str | None,
    temperature: float = 0.0,
    progress: bool = False,
    plot: str | None = None,
) -> dict:
    """The workload's prompts decoded plainly, then with engine.speculative_config (ngram K=4 when none is given),
    at batch_size concurrent requests; a table on stdout and, with output, JSON; with plot, a chart of the speedup
    and per-position acceptance (verispec/plot.py; needs the `plot` extra). progress: a bar per run on stderr."""

    spec = engine.speculative_config
    if spec is None:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    # everything that can be checked is checked before the first (slow) run
    for name, value in (("num_prompts", num_prompts), ("batch_size", batch_size), ("max_tokens", max_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    # validates the workload name before loading anything
    convs = build_workload(workload, num_prompts)
    if output:
        if not Path(output).resolve().parent.is_dir():
            raise ValueError(f"--output {output}: its folder does not exist")
    if plot:
        check_plot_path(plot)
    kw = {k: v for k, v in vars(engine).items() if k != "speculative_config"} | {"max_num_seqs": batch_size}
    model = engine.model
    # the plain run has no speculation to report per request
    plain = LLM(**kw | {"per_request_spec_decode_metrics": "none"})
    # a bad config fails now, not after the plain run
    resolve_speculative_config(spec, plain.max_model_len, target_model=model)
    tok = plain.tokenizer
    prompts = chat_prompt_ids(tok, convs)
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0 if temperature else None)
    base, base_outs = time_llm(plain, prompts, sp, "plain", progress, batch_size)
    del plain
    fast = LLM(**kw, speculative_config=spec)
    res, outs = time_llm(fast, prompts, sp, f"{spec.get('method', spec.get('model'))}", progress, batch_size)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, base_outs))
    print(
        f"model={model} workload={workload} prompts={num_prompts} batch={batch_size} max_tokens={max_tokens} "
        f"spec={json.dumps(spec)}"
    )
    print_table([base, res], base)
    print(f"identical outputs (greedy check): {same}/{len(prompts)}")
    result = {
        "model": model,
        "workload": workload,
        "batch_size": batch_size,
        "spec": spec,
        "plain": asdict(base),
        "spec_run": asdict(res),
        "speedup": res.tok_per_s / base.tok_per_s,
        "identical_outputs": same,
        "num_prompts": len(prompts),
    }
    if output:
        with open(output, "w") as f:
            json.dump(result, f, indent=2)
    if plot:
        title = f"{Path(str(model)).name}, {workload}, {len(prompts)} prompts, batch {batch_size}"
        plot_spec_decode([result["plain"], result["spec_run"]], plot, title)
        print(f"plot: {plot}")
    return result
