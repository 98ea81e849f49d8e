"""Automatic prefix caching on the workloads it is for, cache on beside cache off in one process.

    python benchmarks/prefix_cache.py --model qwen2.5-coder-1.5b-instruct --output prefix_cache.json

- turn 2 of a chat behind a --history-token history (MT-bench's two turns after a long system prompt): time to
  first token of the second turn, the first turn's answer and the history cached or not;
- an agent loop: one source file resent with 8 successive edit instructions (each call carries the file and the
  previous answer), end to end, cache off / on / on with suffix decoding (and, with --drafter, a drafter of the
  target's states with the cache off and on);
- 16 chats sharing a 1,000-token system prompt, submitted together after one warm-up chat, end to end;
- capacity: how many requests of mixed lengths run at once in one KV budget, paged, against what the slot-major
  cache (one max_model_len slot a sequence) held in the same bytes.
Greedy; every cached run's outputs are compared with the uncached run's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import llama_cpp_peer
from adaptive_k import cpu_model

from verispec import LLM, SamplingParams
from verispec.loader.checkpoint import resolve_model_path
from verispec.workloads import mtbench_turns

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "verispec" / "engine" / "scheduler.py"
EDITS = [
    "Add a docstring to every method that lacks one.",
    "Rename the variable `req` to `request` everywhere.",
    "Add type hints to the helper function at the end.",
    "Make `admit` log how many requests it admitted.",
    "Turn the `while` loop in `make_room` into a `for` loop if you can.",
    "Add a `__repr__` to the Scheduler class.",
    "Sort the imports alphabetically.",
    "Add a module-level constant for the default lookahead of 0 and use it.",
]


def chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def timed(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def history_text(llm: LLM, tokens: int) -> str:
    """About `tokens` tokens of real code as a system prompt."""
    ids = llm.tokenizer.encode(
        (ROOT / "verispec" / "engine" / "engine.py").read_text(), add_special_tokens=False
    )
    return "You review this code:\n" + llm.tokenizer.decode(ids[:tokens])


def turn_two(llms: dict[str, LLM], history: int) -> dict:
    """Turn 2's time to first token (one output token), the first turn run in full before it."""
    first = next(iter(llms.values()))
    system = history_text(first, history)
    q = (mtbench_turns(1) or [["Explain what this code does.", "Now list three risks in it."]])[0]
    out = {}
    for label, llm in llms.items():
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q[0]}]
        _, (answer,) = timed(llm, [chat_ids(llm, msgs)], SamplingParams(temperature=0, max_tokens=64))
        msgs += [
            {"role": "assistant", "content": llm.tokenizer.decode(answer)},
            {"role": "user", "content": q[1]},
        ]
        ids = chat_ids(llm, msgs)
        ttft, _ = timed(llm, [ids], SamplingParams(temperature=0, max_tokens=1))
        out[label] = {"turn2_prompt_tokens": len(ids), "ttft_s": ttft}
    return out


def agent_loop(llms: dict[str, LLM], max_tokens: int) -> dict:
    """8 calls, each the file, the last answer and the next instruction."""
    code = SOURCE.read_text()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    out = {}
    for label, llm in llms.items():
        llm.reset_prefix_cache()
        answer, seconds, tokens = "", 0.0, []
        for edit in EDITS:
            msgs = [{"role": "system", "content": f"You edit this file:\n```python\n{code}```"}]
            if answer:
                msgs += [{"role": "assistant", "content": answer}]
            msgs += [{"role": "user", "content": edit}]
            dt, (ids,) = timed(llm, [chat_ids(llm, msgs)], sp)
            seconds += dt
            tokens.append(ids)
            answer = llm.tokenizer.decode(ids)
        out[label] = {"seconds": seconds, "outputs": tokens}
    return out


def agent_loop_llama_cpp(llm: LLM, model: str, threads: int, max_tokens: int) -> dict | None:
    """The agent loop on llama.cpp with its prompt cache (each call keeps the previous call's shared prefix), the
    same token ids as verispec's calls; None without llama-cpp-python or a GGUF model."""
    path = resolve_model_path(model)
    if not llama_cpp_peer.available() or path.suffix != ".gguf":
        return None
    peer = llama_cpp_peer.load(path, threads, n_ctx=4096)
    eos = set(llm.engine.eos_token_ids)
    code, answer, seconds, tokens = SOURCE.read_text(), "", 0.0, []
    llama_cpp_peer.generate(peer, [1, 2, 3], 2, eos)
    for edit in EDITS:
        msgs = [{"role": "system", "content": f"You edit this file:\n```python\n{code}```"}]
        if answer:
            msgs += [{"role": "assistant", "content": answer}]
        msgs += [{"role": "user", "content": edit}]
        t = time.perf_counter()
        ids = llama_cpp_peer.generate(peer, chat_ids(llm, msgs), max_tokens, eos, keep_prefix=True)
        seconds += time.perf_counter() - t
        tokens.append(ids)
        answer = llm.tokenizer.decode(ids)
    return {"seconds": seconds, "outputs": tokens}


def shared_system(llms: dict[str, LLM], n: int, max_tokens: int) -> dict:
    first = next(iter(llms.values()))
    system = history_text(first, 1000)
    qs = [turns[0] for turns in mtbench_turns(n)] or [
        f"Question {i}: what does line {i} do?" for i in range(n)
    ]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    out = {}
    for label, llm in llms.items():
        llm.reset_prefix_cache()
        prompts = [
            chat_ids(llm, [{"role": "system", "content": system}, {"role": "user", "content": q}]) for q in qs
        ]
        # one chat before the others arrive: the system prompt is then cached for them
        timed(llm, prompts[:1], sp)
        seconds, outs = timed(llm, prompts[1:], sp)
        out[label] = {"seconds": seconds, "outputs": outs}
    return out


def capacity(model: str, budget_tokens: int, max_model_len: int, activation_dtype: str = "float32") -> dict:
    """Most requests running at once: 64 requests of 50-1,000 prompt tokens and 64 output tokens in a budget of
    `budget_tokens` tokens of KV."""
    kw = dict(max_model_len=max_model_len, enable_prefix_caching=False, activation_dtype=activation_dtype)
    probe = LLM(model, max_num_seqs=1, **kw)
    per_tok = probe.engine.runner.model.cfg.kv_bytes_per_token
    del probe
    llm = LLM(model, max_num_seqs=64, kv_cache_memory_bytes=budget_tokens * per_tok, **kw)
    e, most = llm.engine, 0
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(64):
        e.add_request(str(i), None, [100 + (i * 7) % 500] * (50 + (i * 397) % 950), sp)
    while e.has_unfinished():
        e.step()
        most = max(most, len(e.running))
    slot_major = budget_tokens // (max_model_len + 1)
    return {"budget_tokens": budget_tokens, "paged_most_running": most, "slot_major_slots": slot_major}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--no-capacity", action="store_true", help="skip the capacity run (64 prompts: long on a 1.5B)"
    )
    ap.add_argument(
        "--drafter",
        help="a speculative_config (JSON) also run on the agent loop with the cache off and on, e.g. "
        '\'{"method": "eagle3", "num_speculative_tokens": 3}\' (the shipped SmolLM2 draft), whose drafts read '
        "the cached positions' states",
    )
    ap.add_argument(
        "--drafter-only",
        action="store_true",
        help="run only the agent loop with --drafter and the cache on (e.g. to compare two builds)",
    )
    ap.add_argument("--capacity-only", action="store_true", help="run only the capacity measurement")
    ap.add_argument("--activation-dtype", default="float32", choices=("float32", "int8"))
    ap.add_argument("--output", help="JSON file for the results")
    args = ap.parse_args()
    kw = dict(
        max_model_len=4096, max_num_seqs=16, threads=args.threads, activation_dtype=args.activation_dtype
    )
    if args.capacity_only:
        cap = capacity(args.model, 16 * 1024, 1024, args.activation_dtype)
        print(f"model={args.model} cpu={cpu_model()} activation_dtype={args.activation_dtype}")
        print(
            f"capacity in {cap['budget_tokens']} tokens of KV: paged ran {cap['paged_most_running']} requests at "
            f"once, the slot-major cache holds {cap['slot_major_slots']} ({cap['paged_most_running'] / cap['slot_major_slots']:.1f}x)"
        )
        if args.output:
            Path(args.output).write_text(
                json.dumps({"cpu": cpu_model(), "args": vars(args), **cap}, indent=2)
            )
        return
    if args.drafter_only:
        llm = LLM(args.model, speculative_config=json.loads(args.drafter), **kw)
        run = agent_loop({"on+drafter": llm}, args.max_tokens)["on+drafter"]
        stats = llm.engine.counters.spec
        print(f"model={args.model} cpu={cpu_model()} drafter={args.drafter}")
        print(f"agent loop, 8 calls, cache on, with the drafter: {run['seconds']:.2f} s")
        print(f"drafts accepted / drafted: {stats.num_accepted_tokens} / {stats.num_draft_tokens}")
        if args.output:
            Path(args.output).write_text(
                json.dumps({"cpu": cpu_model(), "args": vars(args), **run}, indent=2)
            )
        return
    off = LLM(args.model, enable_prefix_caching=False, **kw)
    on = LLM(args.model, **kw)
    suffix = LLM(args.model, speculative_config={"method": "suffix"}, **kw)
    res = {"model": args.model, "cpu": cpu_model()}
    res["turn2"] = turn_two({"off": off, "on": on}, args.history)
    loops = {"off": off, "on": on, "on+suffix": suffix}
    if args.drafter:
        spec = json.loads(args.drafter)
        loops["off+drafter"] = LLM(args.model, enable_prefix_caching=False, speculative_config=spec, **kw)
        loops["on+drafter"] = LLM(args.model, speculative_config=spec, **kw)
    res["agent"] = agent_loop(loops, args.max_tokens)
    peer = agent_loop_llama_cpp(on, args.model, args.threads, args.max_tokens)
    res["shared"] = shared_system({"off": off, "on": on}, args.chats, args.max_tokens // 2)
    res["capacity"] = (
        None if args.no_capacity else capacity(args.model, 16 * 1024, 1024, args.activation_dtype)
    )
    t2, ag, sh = res["turn2"], res["agent"], res["shared"]
    print(f"model={args.model} cpu={res['cpu']}")
    print(f"{'measure':<44}{'cache off':>11}{'cache on':>11}{'ratio':>8}")
    print(
        f"{'turn-2 TTFT, s (' + str(t2['on']['turn2_prompt_tokens']) + ' tokens)':<44}"
        f"{t2['off']['ttft_s']:>11.3f}{t2['on']['ttft_s']:>11.3f}{t2['on']['ttft_s'] / t2['off']['ttft_s']:>7.2f}x"
    )
    print(
        f"{'agent loop, 8 calls, s':<44}{ag['off']['seconds']:>11.2f}{ag['on']['seconds']:>11.2f}"
        f"{ag['off']['seconds'] / ag['on']['seconds']:>7.2f}x"
    )
    print(
        f"{'agent loop with suffix decoding, s':<44}{'':>11}{ag['on+suffix']['seconds']:>11.2f}"
        f"{ag['off']['seconds'] / ag['on+suffix']['seconds']:>7.2f}x"
    )
    if args.drafter:
        d_off, d_on = ag["off+drafter"]["seconds"], ag["on+drafter"]["seconds"]
        name = json.loads(args.drafter)["method"]
        print(f"{'agent loop with ' + name + ', s':<44}{d_off:>11.2f}{d_on:>11.2f}{d_off / d_on:>7.2f}x")
    print(
        f"{f'{args.chats - 1} chats behind a shared system prompt, s':<44}{sh['off']['seconds']:>11.2f}"
        f"{sh['on']['seconds']:>11.2f}{sh['off']['seconds'] / sh['on']['seconds']:>7.2f}x"
    )
    if peer is not None:
        res["agent_llama_cpp"] = peer
        print(
            f"{'agent loop on llama.cpp (its prompt cache), s':<44}{'':>11}{peer['seconds']:>11.2f}"
            f"{peer['seconds'] / ag['on+suffix']['seconds']:>7.2f}x (verispec with suffix against it)"
        )
    cap = res["capacity"]
    if cap is not None:
        print(
            f"capacity in {cap['budget_tokens']} tokens of KV: paged ran {cap['paged_most_running']} requests at "
            f"once, the slot-major cache held {cap['slot_major_slots']}"
        )
    same = {
        "agent": all(a["outputs"] == ag["off"]["outputs"] for a in ag.values()),
        "shared": sh["on"]["outputs"] == sh["off"]["outputs"],
    }
    print(f"identical outputs with the cache (and with suffix decoding): {same}")
    res["identical"] = same
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
