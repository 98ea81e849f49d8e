"""Structured outputs with speculation, side by side in one run: 20 JSON-schema extraction tasks and a tool-calling
set (benchmarks/structured_data.py), batch 1, greedy.

    .venv/bin/python benchmarks/structured_outputs.py --model qwen2.5-coder-1.5b-instruct --output so.json

Rows: plain decoding without and with the grammar (the grammar's overhead per decode step), `ngram` under the
grammar without and with grammar-forced drafts, grammar-forced drafts alone (a proposer that drafts nothing), and
llama.cpp with the schema as a GBNF grammar (llama-cpp-python, if installed). Every output is checked against its
schema (jsonschema), every speculative run's tokens against plain decoding's under the same grammar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llama_cpp_peer
from adaptive_k import cpu_model
from structured_data import EXTRACTION, TOOL_REQUESTS, TOOLS

from verispec import LLM, SamplingParams
from verispec.engine import drafting
from verispec.loader.checkpoint import resolve_model_path
from verispec.proposers.base import Proposal, ProposerNeeds
from verispec.sample import grammar as grammar_mod
from verispec.sample import step as step_mod
from verispec.sampling_params import StructuredOutputsParams
from verispec.server.tools import required_schema

NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
NO_DRAFTS = {"method": "custom_class", "model": "structured_outputs.NoDrafts", "num_speculative_tokens": 8}


class NoDrafts:
    """A proposer that drafts nothing: what is verified is only what the grammar forces."""

    needs = ProposerNeeds()

    def __init__(self, config, context):
        pass

    def add_request(self, req) -> None:
        pass

    def remove_request(self, req, aborted: bool) -> None:
        pass

    def propose(self, reqs, k_max) -> Proposal:
        return Proposal([[] for _ in reqs])


GRAMMAR_SECONDS = [0.0]


def timed(fn):
    """fn, adding its wall time to GRAMMAR_SECONDS: the grammar's own work in a step (drafts cut and forced, the
    masked copy of the logits, the matcher's advance)."""

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            GRAMMAR_SECONDS[0] += time.perf_counter() - t

    return wrapper


step_mod._processed = timed(step_mod._processed)
drafting._grammar_cut = timed(drafting._grammar_cut)
grammar_mod.GrammarState.accept = timed(grammar_mod.GrammarState.accept)


def extraction_prompt(text: str, schema: dict) -> list[dict]:
    return [
        {
            "role": "system",
            "content": "Extract the facts of the user's text as JSON matching this schema:\n"
            + json.dumps(schema),
        },
        {"role": "user", "content": text},
    ]


def tasks(llm: LLM) -> dict[str, list[tuple[list[int], dict]]]:
    tok = llm.tokenizer

    def ids(messages: list[dict], **kw) -> list[int]:
        return tok.encode(
            tok.apply_chat_template(messages, add_generation_prompt=True, **kw), add_special_tokens=False
        )

    extraction = [(ids(extraction_prompt(t, s)), s) for t, s in EXTRACTION]
    # tool_choice "required" as the server constrains it, one call per answer
    schema = {**required_schema(TOOLS), "maxItems": 1}
    tools = [(ids([{"role": "user", "content": q}], tools=TOOLS), schema) for q in TOOL_REQUESTS]
    return {"extraction": extraction, "tools": tools}


def run(llm: LLM, items: list[tuple[list[int], dict]], max_tokens: int, grammar: bool) -> dict:
    """Batch 1, one request after another -> seconds, tokens, decode ms per step, outputs."""
    c = llm.engine.counters
    d0, t0, s0 = c.decode_seconds, c.decode_tokens, c.spec.num_drafts if c.spec else 0
    g0 = GRAMMAR_SECONDS[0]
    # every run starts from an empty prefix cache: what one request of the run caches (the tool set's system turn)
    # serves the next ones, as in a server
    llm.reset_prefix_cache()
    outs, start = [], time.perf_counter()
    for prompt, schema in items:
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True) if grammar else None
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
        outs.append(llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0])
    seconds = time.perf_counter() - start
    steps = c.decode_tokens - t0 if c.spec is None else None
    return {
        "seconds": seconds,
        "tokens": sum(len(o.token_ids) for o in outs),
        "decode_seconds": c.decode_seconds - d0,
        "decode_tokens": c.decode_tokens - t0,
        "plain_steps": steps,
        "drafts": (c.spec.num_drafts - s0) if c.spec else 0,
        "grammar_seconds": GRAMMAR_SECONDS[0] - g0,
        "token_ids": [list(o.token_ids) for o in outs],
        "texts": [o.text for o in outs],
    }


def valid(texts: list[str], schemas: list[dict]) -> int:
    import jsonschema

    n = 0
    for text, schema in zip(texts, schemas):
        try:
            jsonschema.validate(json.loads(text), schema)
            n += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return n


def peer_run(gguf: Path, threads: int, items, max_tokens: int, eos: set[int]) -> dict:
    """llama.cpp with each schema as a GBNF grammar (its json-schema-to-grammar), greedy, batch 1."""
    import llama_cpp

    model = llama_cpp_peer.load(gguf, threads, n_ctx=4096)
    grammars = [llama_cpp.LlamaGrammar.from_json_schema(json.dumps(s), verbose=False) for _, s in items]
    outs, start = [], time.perf_counter()
    for (prompt, _), g in zip(items, grammars):
        model.reset()
        toks = []
        for t in model.generate(
            prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, grammar=g
        ):
            toks.append(int(t))
            if t in eos or len(toks) >= max_tokens:
                break
        outs.append(toks)
    seconds = time.perf_counter() - start
    texts = [llama_cpp_peer_text(model, o, eos) for o in outs]
    return {"seconds": seconds, "tokens": sum(len(o) for o in outs), "token_ids": outs, "texts": texts}


def llama_cpp_peer_text(model, tokens: list[int], eos: set[int]) -> str:
    return model.detokenize([t for t in tokens if t not in eos]).decode("utf-8", errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--activation-dtype", default="float32")
    ap.add_argument(
        "--rounds", type=int, default=2, help="interleaved rounds of every config (medians reported)"
    )
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    # prefix caching on, as users run it: the tool set's system turn is the same in every request
    common = dict(max_model_len=4096, activation_dtype=args.activation_dtype)
    if args.threads:
        common["threads"] = args.threads
    configs = [
        ("plain, no grammar", None, False, True),
        ("plain + grammar", None, True, True),
        ("ngram + grammar, no forced drafts", NGRAM, True, False),
        ("ngram + grammar", NGRAM, True, True),
        ("forced drafts alone", NO_DRAFTS, True, True),
    ]
    engines = {
        json.dumps(spec, sort_keys=True): LLM(args.model, speculative_config=spec, **common)
        for _, spec, _, _ in configs
    }
    work = tasks(engines["null"])
    rows: dict[str, dict] = {}
    real_forced = timed(drafting._grammar_forced)
    for _name, spec, grammar, _ in configs:
        # one untimed warm-up request per engine and workload (kernels, the prefix cache's shared system turn)
        for items in work.values():
            run(engines[json.dumps(spec, sort_keys=True)], items[:1], 8, grammar)
    for i in range(args.rounds):
        for name, spec, grammar, forced in configs:
            # unconstrained output runs to max_tokens: once is enough for what it shows
            if not grammar and i > 0:
                continue
            drafting._grammar_forced = real_forced if forced else (lambda spec, kept, caps: 0)
            for workload, items in work.items():
                r = run(engines[json.dumps(spec, sort_keys=True)], items, args.max_tokens, grammar)
                rows.setdefault(f"{workload} | {name}", {"rounds": []})["rounds"].append(r)
    drafting._grammar_forced = real_forced
    for key, row in rows.items():
        row.update(median_of(row["rounds"]))
        items = work[key.split(" |")[0]]
        row["valid"] = valid(row["texts"], [s for _, s in items]) if "no grammar" not in key else None
    if not args.no_peer and llama_cpp_peer.available():
        gguf = resolve_model_path(args.model)
        eos = set(engines["null"].engine.eos_token_ids)
        for workload, items in work.items():
            r = peer_run(gguf, args.threads or 2, items, args.max_tokens, eos)
            r["valid"] = valid(r["texts"], [s for _, s in items])
            rows[f"{workload} | llama.cpp + GBNF grammar"] = r
    report(rows, work, args)


def median_of(rounds: list[dict]) -> dict:
    """A config's rounds -> the first round's outputs with the median seconds (greedy: every round's tokens are the
    same, checked)."""
    first = dict(rounds[0])
    assert all(r["token_ids"] == first["token_ids"] for r in rounds), "a round's outputs differ"
    for k in ("seconds", "decode_seconds", "grammar_seconds"):
        first[k] = statistics.median(r[k] for r in rounds)
    first["round_seconds"] = [r["seconds"] for r in rounds]
    return first


def report(rows: dict[str, dict], work: dict, args) -> None:
    print(
        f"model {args.model}, {cpu_model()}, batch 1, greedy, max_tokens {args.max_tokens}, {args.rounds} rounds"
    )
    print(
        f"{'workload | config':48s} {'tok':>5s} {'s':>6s} {'tok/s':>6s} {'x':>5s} {'decode tok/s':>12s} {'x':>5s} "
        f"{'valid':>6s} {'same':>5s}"
    )
    for workload, items in work.items():
        base = rows[f"{workload} | plain + grammar"]
        base_dec = base["decode_tokens"] / base["decode_seconds"]
        for key, r in rows.items():
            if not key.startswith(workload + " |"):
                continue
            r["tok_s"] = r["tokens"] / r["seconds"]
            r["speedup"] = r["tok_s"] / (base["tokens"] / base["seconds"])
            r["same_as_plain"] = r["token_ids"] == base["token_ids"]
            dec, x = f"{'-':>12s}", f"{'-':>5s}"
            if r.get("decode_seconds"):
                r["decode_tok_s"] = r["decode_tokens"] / r["decode_seconds"]
                r["decode_speedup"] = r["decode_tok_s"] / base_dec
                dec, x = f"{r['decode_tok_s']:12.1f}", f"{r['decode_speedup']:5.2f}"
            v = "" if r.get("valid") is None else f"{r['valid']}/{len(items)}"
            print(
                f"{key:48s} {r['tokens']:5d} {r['seconds']:6.2f} {r['tok_s']:6.1f} {r['speedup']:5.2f} {dec} {x} "
                f"{v:>6s} {str(r['same_as_plain']):>5s}"
            )
        # plain decoding under the grammar: one step per token; the grammar's own work timed inside those steps
        steps = max(1, base["decode_tokens"])
        own = base["grammar_seconds"] / steps
        step = base["decode_seconds"] / steps - own
        print(
            f"  {workload}: the grammar's work {own * 1e3:.2f} ms a decode step, {own / step * 100:.1f}% of the "
            f"{step * 1e3:.1f} ms step without it"
        )
        rows[f"{workload} | grammar overhead per step"] = {"grammar_ms": own * 1e3, "step_ms": step * 1e3}
    if args.output:
        out = {"model": args.model, "cpu": cpu_model(), "max_tokens": args.max_tokens, "rows": rows}
        Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
