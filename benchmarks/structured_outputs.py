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

NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


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


def required_tools_schema(tools: list[dict]) -> dict:
    """tool_choice "required" as vLLM constrains it: an array of calls, each a tool's name with its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": t["function"]["parameters"],
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "maxItems": 1}


def tasks(llm: LLM) -> dict[str, list[tuple[list[int], dict]]]:
    tok = llm.tokenizer

    def ids(messages: list[dict], **kw) -> list[int]:
        return tok.encode(
            tok.apply_chat_template(messages, add_generation_prompt=True, **kw), add_special_tokens=False
        )

    extraction = [(ids(extraction_prompt(t, s)), s) for t, s in EXTRACTION]
    schema = required_tools_schema(TOOLS)
    tools = [(ids([{"role": "user", "content": q}], tools=TOOLS), schema) for q in TOOL_REQUESTS]
    return {"extraction": extraction, "tools": tools}


def run(llm: LLM, items: list[tuple[list[int], dict]], max_tokens: int, grammar: bool) -> dict:
    """Batch 1, one request after another -> seconds, tokens, decode ms per step, outputs."""
    c = llm.engine.counters
    d0, t0, s0 = c.decode_seconds, c.decode_tokens, c.spec.num_drafts if c.spec else 0
    g0 = GRAMMAR_SECONDS[0]
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
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    # prefix caching on, as users run it: the tool set's system turn is the same in every request
    common = dict(max_model_len=4096, activation_dtype=args.activation_dtype)
    if args.threads:
        common["threads"] = args.threads
    plain = LLM(args.model, **common)
    work = tasks(plain)
    rows: dict[str, dict] = {}
    configs = [
        ("plain, no grammar", None, False, True),
        ("plain + grammar", None, True, True),
        ("ngram + grammar, no forced drafts", NGRAM, True, False),
        ("ngram + grammar", NGRAM, True, True),
        (
            "forced drafts alone",
            {"method": "custom_class", "model": "structured_outputs.NoDrafts", "num_speculative_tokens": 8},
            True,
            True,
        ),
    ]
    engines = {None: plain}
    real_forced = timed(drafting._grammar_forced)
    for name, spec, grammar, forced in configs:
        key = json.dumps(spec, sort_keys=True) if spec else None
        if key not in engines:
            engines[key] = LLM(args.model, speculative_config=spec, **common)
        drafting._grammar_forced = real_forced if forced else (lambda spec, kept, caps: 0)
        for workload, items in work.items():
            # one untimed warm-up request (kernels, grammar compile cache is per schema: not warmed)
            run(engines[key], items[:1], 8, grammar)
            rows[f"{workload} | {name}"] = r = run(engines[key], items, args.max_tokens, grammar)
            r["valid"] = valid(r["texts"], [s for _, s in items]) if grammar else None
    drafting._grammar_forced = real_forced
    if not args.no_peer and llama_cpp_peer.available():
        gguf = resolve_model_path(args.model)
        eos = set(plain.engine.eos_token_ids)
        for workload, items in work.items():
            r = peer_run(gguf, args.threads or plain.engine.opts.threads or 2, items, args.max_tokens, eos)
            r["valid"] = valid(r["texts"], [s for _, s in items])
            rows[f"{workload} | llama.cpp + GBNF grammar"] = r
    report(rows, work, args)


def report(rows: dict[str, dict], work: dict, args) -> None:
    print(f"model {args.model}, {cpu_model()}, batch 1, greedy, max_tokens {args.max_tokens}")
    print(
        f"{'workload | config':58s} {'tok':>6s} {'s':>7s} {'tok/s':>7s} {'x plain+g':>9s} {'valid':>6s} {'same':>5s}"
    )
    for workload, items in work.items():
        base = rows[f"{workload} | plain + grammar"]
        for key, r in rows.items():
            if not key.startswith(workload + " |"):
                continue
            r["tok_s"] = r["tokens"] / r["seconds"]
            r["speedup"] = r["tok_s"] / (base["tokens"] / base["seconds"])
            r["same_as_plain"] = r["token_ids"] == base["token_ids"]
            v = "" if r.get("valid") is None else f"{r['valid']}/{len(items)}"
            print(
                f"{key:58s} {r['tokens']:6d} {r['seconds']:7.2f} {r['tok_s']:7.1f} {r['speedup']:9.2f} {v:>6s} "
                f"{str(r['same_as_plain']):>5s}"
            )
        g, p = rows[f"{workload} | plain + grammar"], rows[f"{workload} | plain, no grammar"]
        step_g = g["decode_seconds"] / max(1, g["decode_tokens"])
        step_p = p["decode_seconds"] / max(1, p["decode_tokens"])
        print(
            f"  {workload}: plain decode step {step_p * 1e3:.2f} ms, with the grammar {step_g * 1e3:.2f} ms "
            f"({(step_g / step_p - 1) * 100:+.1f}%)"
        )
        rows[f"{workload} | grammar overhead per step"] = {
            "plain_ms": step_p * 1e3,
            "grammar_ms": step_g * 1e3,
        }
    if args.output:
        out = {"model": args.model, "cpu": cpu_model(), "max_tokens": args.max_tokens, "rows": rows}
        Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
