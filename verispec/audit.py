"""`verispec audit`: check that a model and speculative configuration are lossless, on the user's own setup.

Two checks, each run with speculation and against the same model without it:

1. Greedy equality: every prompt's greedy continuation with speculation equals the plain one, token for token.
   It runs once as configured (the goodput planner may then verify few drafts) and, when the planner is on, once
   more with `enable_adaptive_verification: false` so that every draft is verified.
2. Sampled law: at the user's temperature / top-p, the second output token (the first one verification emits; the
   first comes from the prefill) must follow the target's exact next-token law. For each sampled first token t1
   the target's law p(. | prompt, t1) comes from a plain forward; a chi-square goodness-of-fit statistic is summed
   over all (prompt, t1) groups (cells with expected count < 5 pooled per group) and compared at `ALPHA`. It runs
   with the planner off so that drafts are verified at that position.

A configuration whose output law is not the target's by design (`rejection_sample_method: synthetic`,
`enable_entropy_verify`: any rule `VerifyRule.lossy_reason` names) fails the audit, "lossy by design", whatever the
tests measure: the audit says whether a configuration changes the output, and these do. Their greedy checks still
run (greedy rows keep the exact rule), and their sampled check is shown for information.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from verispec import LLM
from verispec.engine.args import EngineArgs
from verispec.runner.model_runner import RowInput
from verispec.sample import logits as S
from verispec.sampling_params import SamplingParams

# significance level of the sampled-law test: a lossless engine fails it once in a thousand audits
ALPHA = 1e-3

# short prompts with repeated spans, so that n-gram / suffix drafters find something to propose
DEFAULT_PROMPTS = (
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Monday, Tuesday,",
    "Write a haiku about CPUs.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Q: What is the capital of France?\nA: Paris.\nQ: What is the capital of Italy?\nA:",
    "red green blue red green blue red green",
    "Once upon a time there was a small robot who",
)
SAMPLED_PROMPTS = DEFAULT_PROMPTS[:2]
# the exact marginal law of the second token costs one forward per token p(t1) can sample
MAX_SUPPORT = 4096


@dataclass
class AuditRow:
    check: str
    setting: str
    drafted: int
    accepted: int
    # "pass" | "FAIL" | "warn" | "lossy by design" (a sampled check shown for information; the audit fails on the
    # "output law" row)
    verdict: str
    detail: str

    @property
    def failed(self) -> bool:
        return self.verdict == "FAIL"


# ---------------------------------------------------------------------------- target laws and the statistic


def next_token_probs(llm, contexts: list[list[int]], sp: SamplingParams) -> torch.Tensor:
    """The target's next-token law after each context at `sp`'s temperature / top-p, from plain forwards on the
    engine's (idle) cache slots. -> [N, V] float32 on the CPU."""

    runner = llm.engine.runner
    v = runner.model.cfg.vocab_size
    chunk = runner.cache.num_slots
    out = []
    for start in range(0, len(contexts), chunk):
        part = contexts[start : start + chunk]
        rows = [RowInput(j, 0, list(c), logits_from=len(c) - 1) for j, c in enumerate(part)]
        with runner.cache.borrowed(range(len(part)), max(len(c) for c in part) + 1):
            # [n, V]
            logits = runner.run(rows).logits
        st = S.SamplingTensors.from_params([sp] * len(part), logits.device, v)
        out.append(S.logits_to_probs(logits, st).float().cpu())
    return torch.cat(out)


def second_token_law(llm, prompt: list[int], sp: SamplingParams) -> torch.Tensor:
    """Exact P(second output token) = sum_t1 p(t1) p(t2 | t1). -> [V]. Costs one forward per token in p(t1)'s
    support: for small vocabularies or tight top-p."""
    # [V]
    p1 = next_token_probs(llm, [prompt], sp)[0]
    support = p1.nonzero().flatten().tolist()
    # [S, V]
    p2 = next_token_probs(llm, [prompt + [t] for t in support], sp)
    return (p1[support][:, None] * p2).sum(0)


def chi2_terms(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom of `counts` [V] against `probs` [V], cells with expected count
    below 5 pooled into one."""
    n = float(counts.sum())
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)]).double()
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    # observations in cells the target gives probability 0 can never be lossless
    if bool((obs[~keep] > 0).any()):
        stat = torch.tensor(float("inf"), dtype=torch.float64)
    return float(stat), max(int(keep.sum()) - 1, 0)


def chi2_sf(stat: float, df: int) -> float:
    """P(chi2_df >= stat)."""
    if df <= 0:
        return 1.0
    return float(
        torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0))
    )


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value of `counts` [V] against `probs` [V]."""
    return chi2_sf(*chi2_terms(counts, probs))


def second_token_test(
    llm, prompts: list[list[int]], samples: list[list[tuple[int, int]]], sp: SamplingParams
) -> tuple[float, int, int | None]:
    """Chi-square of sampled (t1, t2) pairs, summed over prompts, against the target's law of t2. Where p(t1) has
    at most `MAX_SUPPORT` tokens the law is the exact marginal (`second_token_law`); otherwise the pairs are grouped
    by t1 and each group is tested against p(t2 | prompt, t1). -> (p-value, degrees of freedom, index of the prompt
    with the largest statistic per degree of freedom)."""
    total, df, worst, worst_score = 0.0, 0, None, -1.0
    for i, (prompt, pairs) in enumerate(zip(prompts, samples)):
        # [V]
        p1 = next_token_probs(llm, [prompt], sp)[0]
        v = p1.shape[0]
        seconds = torch.tensor([t2 for _, t2 in pairs])
        if int((p1 > 0).sum()) <= MAX_SUPPORT:
            stat, d = chi2_terms(
                torch.bincount(seconds, minlength=v).double(), second_token_law(llm, prompt, sp)
            )
        else:
            firsts = sorted({t1 for t1, _ in pairs})
            laws = next_token_probs(llm, [prompt + [t1] for t1 in firsts], sp)
            stat, d = 0.0, 0
            for t1, law in zip(firsts, laws):
                group = torch.tensor([t2 for a, t2 in pairs if a == t1])
                s_, d_ = chi2_terms(torch.bincount(group, minlength=v).double(), law)
                stat, d = stat + s_, d + d_
        total, df = total + stat, df + d
        if d > 0 and stat / d > worst_score:
            worst, worst_score = i, stat / d
    return chi2_sf(total, df), df, worst


# ---------------------------------------------------------------------------- prompts


def read_prompts(path: str, tokenizer) -> list[list[int]]:
    """One prompt per line, encoded. A line starting with `{` or `[` is JSON: `{"prompt": "..."}`,
    `{"messages": [...]}` or a list of chat messages; messages go through the model's chat template (special tokens
    come from the template). Blank lines are skipped."""
    if tokenizer is None:
        raise ValueError("the model has no tokenizer (tokenizer.json): text prompts cannot be encoded")
    text = Path(path).read_text(encoding="utf-8") if Path(path).is_file() else None
    if text is None:
        raise ValueError(f"--prompts {path!r}: no such file")
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip()[:1] not in "{[":
            prompts.append(tokenizer.encode(line))
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts {path}:{n}: invalid JSON ({e.msg})") from None
        messages = item.get("messages") if isinstance(item, Mapping) else item
        if isinstance(item, Mapping) and isinstance(item.get("prompt"), str):
            prompts.append(tokenizer.encode(item["prompt"]))
        elif isinstance(messages, list) and messages and all(isinstance(m, Mapping) for m in messages):
            text = tokenizer.apply_chat_template(list(messages))
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            raise ValueError(
                f"--prompts {path}:{n}: expected a text line, {{'prompt': str}} or chat messages"
            )
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts")
    return prompts


# ---------------------------------------------------------------------------- the audit


def _encode(llm, prompts: tuple[str, ...]) -> list[list[int]]:
    if llm.tokenizer is None:
        raise ValueError("the model has no tokenizer (tokenizer.json): text prompts cannot be encoded")
    return [llm.tokenizer.encode(p) for p in prompts]


def _spec_counts(llm) -> tuple[int, int]:
    s = llm.engine.counters.spec
    return s.num_draft_tokens, s.num_accepted_tokens


def _show(llm, token: int) -> str:
    return f"{token} ({llm.tokenizer.decode([token])!r})" if llm.tokenizer is not None else str(token)


def greedy_check(
    plain, spec_llm, ids: list[list[int]], max_tokens: int, setting: str, progress: bool
) -> AuditRow:
    """Greedy continuations of every prompt, batched, with and without speculation."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ids]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=progress)]
    d0, a0 = _spec_counts(spec_llm)
    got = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, sp, use_tqdm=progress)]
    d1, a1 = _spec_counts(spec_llm)
    drafted, accepted = d1 - d0, a1 - a0
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            pos = next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
            a = _show(plain, w[pos]) if pos < len(w) else "end"
            b = _show(plain, g[pos]) if pos < len(g) else "end"
            detail = f"prompt {i}, output position {pos}: plain {a}, speculative {b}"
            return AuditRow("greedy equality", setting, drafted, accepted, "FAIL", detail)
    detail = f"{len(ids)} prompts x {max_tokens} tokens identical"
    if drafted == 0:
        return AuditRow("greedy equality", setting, 0, 0, "warn", detail + "; nothing was drafted")
    return AuditRow("greedy equality", setting, drafted, accepted, "pass", detail)


def sampled_check(
    plain,
    spec_llm,
    ids: list[list[int]],
    n: int,
    temperature: float,
    top_p: float,
    lossy: str | None,
    progress: bool,
) -> AuditRow:
    """`n` 3-token samples per prompt; the second token against the target's exact law given the first."""
    setting = f"T={temperature:g} top_p={top_p:g}, planner off"
    sp = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=3, ignore_eos=True)
    d0, a0 = _spec_counts(spec_llm)
    samples = []
    for p in ids:
        outs = spec_llm.generate([{"prompt_token_ids": p}] * n, sp, use_tqdm=progress)
        samples.append([(o.outputs[0].token_ids[0], o.outputs[0].token_ids[1]) for o in outs])
    d1, a1 = _spec_counts(spec_llm)
    drafted, accepted = d1 - d0, a1 - a0
    pvalue, df, worst = second_token_test(plain, ids, samples, replace(sp, max_tokens=1))
    detail = f"{len(ids)} prompts x {n} samples, chi-square p={pvalue:.3g} (df {df}, alpha {ALPHA:g})"
    if lossy is not None:
        return AuditRow("sampled law", setting, drafted, accepted, "lossy by design", f"{lossy}; {detail}")
    if drafted == 0:
        return AuditRow(
            "sampled law", setting, 0, 0, "FAIL", detail + "; nothing was drafted, nothing verified"
        )
    if df == 0:
        return AuditRow(
            "sampled law", setting, drafted, accepted, "FAIL", detail + "; too few samples (--samples)"
        )
    if pvalue < ALPHA:
        where = f"prompt {worst}, output position 1 (the first speculative position)"
        return AuditRow("sampled law", setting, drafted, accepted, "FAIL", f"{where}: {detail}")
    if drafted < n * len(ids) // 10:
        return AuditRow(
            "sampled law", setting, drafted, accepted, "warn", detail + "; few drafts: weak evidence"
        )
    return AuditRow("sampled law", setting, drafted, accepted, "pass", detail)


def run_audit(
    args: EngineArgs,
    prompts: str | None = None,
    samples: int = 400,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_tokens: int = 32,
    progress: bool = False,
) -> list[AuditRow]:
    """Every check of the audit on `args` (which must have a speculative_config), on the prompts of the file
    `prompts` (`read_prompts`) or the built-in ones; ValueError for a bad setting."""

    spec = args.speculative_config
    if not spec:
        raise ValueError("audit needs a speculative configuration (-sc / --speculative-config)")
    if samples < 0 or max_tokens < 1:
        raise ValueError(f"--samples must be >= 0 and --max-tokens >= 1, got {samples} and {max_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"--temperature must be >= 0 and --top-p in (0, 1], got {temperature} and {top_p}")
    plain = LLM(**vars(replace(args, speculative_config=None, per_request_spec_decode_metrics="none")))
    ids = read_prompts(prompts, plain.tokenizer) if prompts is not None else _encode(plain, DEFAULT_PROMPTS)
    rows = []
    planner_on = spec.get("enable_adaptive_verification", True)
    if planner_on:
        llm = LLM(**vars(args))
        rows.append(greedy_check(plain, llm, ids, max_tokens, "as configured (planner on)", progress))
        del llm
    forced = replace(args, speculative_config={**spec, "enable_adaptive_verification": False})
    llm = LLM(**vars(forced))
    # the rule the engine verifies with, as resolved from the configuration
    lossy = llm.engine.opts.verify.lossy_reason
    if lossy is not None:
        # not the target's law by design: a failure even where the sampled test happens to pass
        rows.insert(0, AuditRow("output law", "by configuration", 0, 0, "FAIL", f"lossy by design: {lossy}"))
    row = greedy_check(plain, llm, ids, max_tokens, "planner off: every draft verified", progress)
    # with every draft verified, a drafter that drafts nothing leaves the audit without evidence
    rows.append(replace(row, verdict="FAIL") if row.verdict == "warn" else row)
    if samples > 0 and temperature > 0:
        sampled_ids = ids[: len(SAMPLED_PROMPTS)] if prompts else _encode(plain, SAMPLED_PROMPTS)
        rows.append(sampled_check(plain, llm, sampled_ids, samples, temperature, top_p, lossy, progress))
    return rows


def format_table(rows: list[AuditRow]) -> str:
    head = ("check", "setting", "drafted", "accepted", "verdict", "detail")
    cells = [head] + [
        (r.check, r.setting, str(r.drafted), str(r.accepted), r.verdict, r.detail) for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(5)) + "  " + c[5] for c in cells]
    return "\n".join(lines)
