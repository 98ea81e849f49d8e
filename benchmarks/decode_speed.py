"""Plain decoding speed: verispec vs transformers' generate on the same model and prompts, plus the roofline.

Greedy, 128 new tokens, batch 1 and batch 8, one process. Each configuration runs once untimed, then --repeats
timed runs (median reported: this VM drifts run to run); verispec's batch sizes take turns, one run each per round,
and the batch-8 / batch-1 ratio is taken within each round (median over rounds). Prints a table and writes JSON.
Rows: verispec as it runs by default (GGUF weights kept quantized, native kernels), verispec with every weight
dequantized to float32 (keep_quantized=False: what transformers holds), and transformers.
verispec with int8 activations (activation_dtype="int8", llama.cpp's numerics) takes its turns in the same rounds as
the default (float32 activations), and a second table puts the two side by side: end to end, decode only and
prompt processing (prompt tokens / seconds in prompt steps), each ratio taken within a round (median over rounds).
On a CPU without the int8 instructions that table is skipped with the reason (--no-int8 skips it anyway).
Two rooflines (measured read bandwidth / bytes streamed per token, embedding table excluded): the dequantized one (the
model as transformers holds it) and the one for the bytes verispec actually streams.
With llama-cpp-python installed (benchmarks/llama_cpp_peer.py), llama.cpp on the same GGUF at batch 1 too.
    .venv/bin/python benchmarks/decode_speed.py [--model smollm2-135m-instruct] [--new-tokens 128] [--repeats 3]
        [--no-transformers] [--no-llama-cpp] [--no-int8] [--device auto|cpu|cuda]
On CUDA (`--device cuda`, or auto where a GPU is present) verispec and transformers both run in bfloat16 on the GPU
and the bandwidth is the GPU's; int8 activations and llama.cpp are CPU-only (skip them with --no-int8
--no-llama-cpp).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import llama_cpp_peer
import torch

from verispec.planner.step_cost import sync

PROMPTS = [
    "Write a haiku about CPUs.",
    "Explain speculative decoding in two sentences.",
    "List five prime numbers and explain why they are prime.",
    "def fibonacci(n):",
    "The capital of France is",
    "Give three tips for writing readable Python code.",
    "What is a hash table?",
    "Describe the water cycle.",
]


def measure_bandwidth_gbs(device: torch.device, mb: int = 1024, reps: int = 5) -> float:
    """Read bandwidth of the device the model runs on, as torch sees it: a large float32 sum (best of reps)."""
    x = torch.ones(mb * (1 << 20) // 4, device=device)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def streamed_bytes(model) -> int:
    """Bytes of weights one decode step reads: parameters plus quantized blocks, the embedding table excluded."""
    params = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    blocks = sum(
        sum(q.nbytes for q in (m.qparts or [m.qweight]))
        for n, m in model.named_modules()
        if getattr(m, "quantized", False) and "embed_tokens" not in n
    )
    return params + blocks


def encode_prompt(tok, text: str) -> list[int]:
    """The prompt as a one-turn chat where the model has a chat template (Gemma 3's GGUF has none), else raw."""
    try:
        return tok.encode(
            tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False
        )
    except ValueError:
        return tok.encode(text)


def verispec_run(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, float]:
    """One timed generate -> (end-to-end tok/s, decode-only tok/s: tokens of decode steps / time in decode steps,
    seconds in prompt processing: sum(len(p) for p in prompts) prompt tokens)."""
    from verispec import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    c = llm.engine.counters
    d0, n0, p0 = c.decode_seconds, c.decode_tokens, c.prefill_seconds
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    e2e = sum(len(o.outputs[0].token_ids) for o in outs) / dt
    return e2e, (c.decode_tokens - n0) / (c.decode_seconds - d0), c.prefill_seconds - p0


def bench_verispec(
    llm, batches: dict[int, list[list[int]]], new_tokens: int, repeats: int, others: tuple = ()
) -> list[dict[int, list[tuple[float, float, float]]]]:
    """batch size -> its timed runs (verispec_run's triples), for `llm` and then each of `others`. Every LLM and
    batch first runs once untimed (the KV cache pages its slots and positions use are touched: first touch zeroes
    them in the kernel, a one-off start-up cost, so the timed runs are the steady state a server sees); then the
    LLMs and batches take turns, one timed run each per round, so the VM's drift over the minutes a run takes falls
    on every one alike and a ratio between batches (or LLMs) can be taken within a round."""
    llms = (llm, *others)
    runs: list[dict[int, list[tuple[float, float, float]]]] = [{b: [] for b in batches} for _ in llms]
    for one in llms:
        for ps in batches.values():
            verispec_run(one, ps, new_tokens)
    for _ in range(repeats):
        for one, out in zip(llms, runs):
            for b, ps in batches.items():
                out[b].append(verispec_run(one, ps, new_tokens))
    return runs


def median_of(runs: list[tuple[float, float, float]], i: int) -> float:
    return statistics.median(r[i] for r in runs)


def bench_transformers(
    model, prompts: list[list[int]], new_tokens: int, pad_id: int, repeats: int
) -> tuple[float, float]:
    """-> (end-to-end tok/s, decode-only tok/s: the same generate minus a 1-token generate (the prefill)), medians."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ids, mask = ids.to(model.device), mask.to(model.device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    e2e, dec = [], []
    with torch.inference_mode():
        # untimed warm-up, as for verispec
        model.generate(input_ids=ids, attention_mask=mask, **kw)
        for _ in range(repeats):
            sync(model.device)
            t = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=mask, **kw)
            sync(model.device)
            dt = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(
                input_ids=ids, attention_mask=mask, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1}
            )
            sync(model.device)
            prefill = time.perf_counter() - t
            e2e.append(len(prompts) * new_tokens / dt)
            dec.append(len(prompts) * (new_tokens - 1) / (dt - prefill))
    return statistics.median(e2e), statistics.median(dec)


def int8_vs_float32(
    rows: list[dict], runs: dict, i8_runs: dict | None, isa: str | None, skipped: str
) -> dict:
    """Print int8 activations against float32 activations (the same quantized weights), per batch: medians of each
    and the median over rounds of the within-round ratio, end to end, decode only and prompt processing."""
    if i8_runs is None:
        print(f"int8 activations skipped: {skipped}")
        return {"skipped": skipped}
    print(f"int8 activations ({isa}) against float32 activations, same weights, same rounds (medians):")
    print(
        f"{'batch':>5} {'f32 tok/s':>10} {'int8 tok/s':>11} {'x':>6} {'f32 decode':>11} {'int8 decode':>12} "
        f"{'x':>6} {'f32 prompt tok/s':>17} {'int8 prompt tok/s':>18} {'x':>6}"
    )
    out = {"isa": isa, "batches": {}}
    for r in rows:
        b, n = r["batch"], r["prompt_tokens"]
        f, i = runs[b], i8_runs[b]
        # ratios within each round; prompt speed is prompt tokens / prompt seconds, so its ratio is f32 s / int8 s
        ratio = [statistics.median(y[k] / x[k] for x, y in zip(f, i)) for k in (0, 1)]
        ratio.append(statistics.median(x[2] / y[2] for x, y in zip(f, i)))
        med = {k: (median_of(f, j), median_of(i, j)) for j, k in enumerate(("e2e", "decode", "prompt_s"))}
        pf, pi = n / med["prompt_s"][0], n / med["prompt_s"][1]
        out["batches"][b] = {
            "medians_f32_int8": med,
            "prompt_tok_s": (pf, pi),
            "ratios": ratio,
            "prompt_tokens": n,
        }
        print(
            f"{b:>5} {med['e2e'][0]:>10.1f} {med['e2e'][1]:>11.1f} {ratio[0]:>5.2f}x {med['decode'][0]:>11.1f} "
            f"{med['decode'][1]:>12.1f} {ratio[1]:>5.2f}x {pf:>17.0f} {pi:>18.0f} {ratio[2]:>5.2f}x"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument(
        "--device",
        default="auto",
        help="auto | cpu | cuda: where verispec and transformers run (on CUDA both in bfloat16; default auto)",
    )
    ap.add_argument(
        "--no-llama-cpp", action="store_true", help="skip llama.cpp even if llama-cpp-python is here"
    )
    ap.add_argument("--no-int8", action="store_true", help="skip the int8-activation runs")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per configuration; the median is reported (default 3)",
    )
    ap.add_argument("--output", default="bench_results/decode_speed.json")
    ap.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="draw tok/s by batch size, one line per engine, to PATH (.png / .svg / .pdf; needs matplotlib)",
    )
    args = ap.parse_args()
    from verispec import LLM, SamplingParams
    from verispec.engine.builder import pick_device
    from verispec.kernels.build import int8_isa
    from verispec.loader.checkpoint import resolve_model_path
    from verispec.plot import check_plot_path, plot_decode_speed

    if args.plot:
        try:
            check_plot_path(args.plot)
        except ValueError as e:
            ap.error(str(e))

    try:
        device = pick_device(args.device)
    except ValueError as e:
        ap.error(str(e))
    # the same prompts every round: timed without the prefix cache
    common = dict(max_model_len=1024, max_num_seqs=8, device=str(device), enable_prefix_caching=False)
    llm = LLM(args.model, **common)
    llm_i8, i8_skipped = None, "--no-int8"
    if not args.no_int8:
        try:
            llm_i8 = LLM(args.model, activation_dtype="int8", **common)
        except ValueError as e:
            i8_skipped = str(e)
    llm_f32 = LLM(args.model, keep_quantized=False, **common)
    tok = llm.tokenizer
    prompts = [encode_prompt(tok, p) for p in PROMPTS]
    # bytes streamed per decoded token: every weight except the embedding table (one row of it is gathered)
    weight_bytes = streamed_bytes(llm_f32.ckpt.model)
    ours_bytes = streamed_bytes(llm.ckpt.model)
    bw = measure_bandwidth_gbs(device)
    roofline = bw * 1e9 / weight_bytes
    roofline_ours = bw * 1e9 / ours_bytes
    hf = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(args.model)
        kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        # the dtype verispec runs in: float32 on the CPU, bfloat16 on CUDA
        dtype = llm_f32.ckpt.model.embed_tokens.weight.dtype
        hf = (
            AutoModelForCausalLM.from_pretrained(str(path.parent if kw else path), dtype=dtype, **kw)
            .to(device)
            .eval()
        )
    sizes = [int(x) for x in args.batches.split(",")]
    batches = {b: (prompts * (b // len(prompts) + 1))[:b] for b in sizes}
    runs, *i8 = bench_verispec(llm, batches, args.new_tokens, args.repeats, (llm_i8,) if llm_i8 else ())
    i8_runs = i8[0] if i8 else None
    (f32_runs,) = bench_verispec(llm_f32, batches, args.new_tokens, 1)
    rows = []
    for b, ps in batches.items():
        ours, ours_dec, ours_pre = (median_of(runs[b], i) for i in range(3))
        theirs, theirs_dec = (
            bench_transformers(hf, ps, args.new_tokens, tok.eos_token_ids[0], args.repeats)
            if hf is not None
            else (None, None)
        )
        rows.append(
            {
                "batch": b,
                "verispec_tok_s": ours,
                "verispec_float32_tok_s": median_of(f32_runs[b], 0),
                "transformers_tok_s": theirs,
                "verispec_decode_tok_s": ours_dec,
                "verispec_prefill_s": ours_pre,
                "transformers_decode_tok_s": theirs_dec,
                "speedup_vs_transformers": ours / theirs if theirs else None,
                "fraction_of_roofline": ours / roofline if b == 1 else None,
                "fraction_of_own_roofline": ours / roofline_ours if b == 1 else None,
                "verispec_runs": runs[b],
                "prompt_tokens": sum(len(p) for p in ps),
                "verispec_int8_runs": i8_runs[b] if i8_runs else None,
            }
        )
    print(
        f"model={args.model} device={device} bandwidth={bw:.1f} GB/s threads={torch.get_num_threads()}\n"
        f"  dequantized weights {weight_bytes / 1e6:.0f} MB/token -> roofline {roofline:.1f} tok/s; "
        f"verispec streams {ours_bytes / 1e6:.0f} MB/token -> roofline {roofline_ours:.1f} tok/s"
    )
    print(
        f"{'batch':>5} {'verispec tok/s':>15} {'dequantized':>14} {'transformers':>13} {'speedup':>8} "
        f"{'% deq roofline':>15} {'% own roofline':>15}"
    )
    for r in rows:
        t = f"{r['transformers_tok_s']:.1f}" if r["transformers_tok_s"] else "-"
        s = f"{r['speedup_vs_transformers']:.2f}x" if r["speedup_vs_transformers"] else "-"
        f = f"{100 * r['fraction_of_roofline']:.0f}%" if r["fraction_of_roofline"] else "-"
        o = f"{100 * r['fraction_of_own_roofline']:.0f}%" if r["fraction_of_own_roofline"] else "-"
        print(
            f"{r['batch']:>5} {r['verispec_tok_s']:>15.1f} {r['verispec_float32_tok_s']:>14.1f} {t:>13} {s:>8} "
            f"{f:>15} {o:>15}"
        )
    print("decode only (prompt processing excluded; verispec's prompt processing in ms at the end):")
    for r in rows:
        t = f"{r['transformers_decode_tok_s']:.1f}" if r["transformers_decode_tok_s"] else "-"
        s = (
            f"{r['verispec_decode_tok_s'] / r['transformers_decode_tok_s']:.2f}x"
            if r["transformers_decode_tok_s"]
            else "-"
        )
        print(
            f"{r['batch']:>5} {r['verispec_decode_tok_s']:>15.1f} {'':>14} {t:>13} {s:>8} "
            f"{1e3 * r['verispec_prefill_s']:>15.1f}"
        )
    int8_table = int8_vs_float32(rows, runs, i8_runs, int8_isa() if i8_runs else None, i8_skipped)
    if llm_i8 is not None and i8_runs is not None:
        # int8 activations read their own layouts (Q4_K / Q6_K: the compact q4kv / q6kv)
        i8_bytes = streamed_bytes(llm_i8.ckpt.model)
        i8_dec = median_of(i8_runs[sizes[0]], 1) if sizes[0] == 1 else None
        int8_table.update(bytes_per_token=i8_bytes, own_roofline_tok_s=bw * 1e9 / i8_bytes)
        line = f"  int8 streams {i8_bytes / 1e6:.0f} MB/token -> roofline {bw * 1e9 / i8_bytes:.1f} tok/s"
        if i8_dec is not None:
            int8_table["fraction_of_own_roofline"] = i8_dec * i8_bytes / (bw * 1e9)
            line += f"; batch 1 decodes at {100 * int8_table['fraction_of_own_roofline']:.0f}% of it"
        print(line)
    peer = None
    if (
        not args.no_llama_cpp
        and llama_cpp_peer.available()
        and resolve_model_path(args.model).suffix == ".gguf"
    ):
        model = llama_cpp_peer.load(resolve_model_path(args.model), torch.get_num_threads())
        e2e, dec, out, pre = llama_cpp_peer.decode_speed(model, prompts[0], args.new_tokens, args.repeats)
        first = (
            llm.generate(
                [{"prompt_token_ids": prompts[0]}],
                SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True),
                use_tqdm=False,
            )[0]
            .outputs[0]
            .token_ids
        )
        a = rows[0]
        peer = {"tok_s": e2e, "decode_tok_s": dec, "prompt_tok_s": pre, "same_greedy_tokens": out == first}
        print(
            f"llama.cpp (llama-cpp-python, batch 1): {e2e:.1f} tok/s end to end (verispec "
            f"{a['verispec_tok_s'] / e2e:.2f}x), {dec:.1f} tok/s decode only (verispec "
            f"{a['verispec_decode_tok_s'] / dec:.2f}x); same greedy tokens as verispec: {out == first}"
        )
        # batch 1 is prompts[0] alone in every verispec run: its prompt speed against llama.cpp's on that prompt
        line = f"  prompt: llama.cpp {pre:.0f} tok/s, verispec float32 activations {a['prompt_tokens'] / a['verispec_prefill_s']:.0f}"
        if i8_runs:
            i8_pre = a["prompt_tokens"] / median_of(i8_runs[a["batch"]], 2)
            sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
            i8_out = (
                llm_i8.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)[0]
                .outputs[0]
                .token_ids
            )
            peer.update(verispec_int8_prompt_tok_s=i8_pre, same_greedy_tokens_as_int8=out == i8_out)
            line += f", int8 activations {i8_pre:.0f}; same greedy tokens as verispec int8: {out == i8_out}"
        print(line)
    elif not args.no_llama_cpp:
        print("llama.cpp peer skipped: llama-cpp-python is not installed (benchmarks/llama_cpp_peer.py)")
    ratios = {}
    if len(sizes) > 1:
        lo, hi = sizes[0], sizes[-1]
        # the ratio within each round (both batches measured minutes apart at most), then the median over rounds
        per_round = [(h[0] / low[0], h[1] / low[1]) for low, h in zip(runs[lo], runs[hi])]
        ratios = {
            "batches": [lo, hi],
            "per_round": per_round,
            "median": statistics.median(r[0] for r in per_round),
            "median_decode_only": statistics.median(r[1] for r in per_round),
        }
        print(
            f"batch {hi} / batch {lo} throughput, median of {len(per_round)} rounds: {ratios['median']:.2f}x "
            f"(decode only {ratios['median_decode_only']:.2f}x); per round: "
            + ", ".join(f"{e:.2f}x ({d:.2f}x)" for e, d in per_round)
        )
    result = {
        "model": args.model,
        "repeats": args.repeats,
        "bandwidth_gbs": bw,
        "weight_bytes": weight_bytes,
        "roofline_tok_s": roofline,
        "verispec_bytes_per_token": ours_bytes,
        "own_roofline_tok_s": roofline_ours,
        "rows": rows,
        "batch_ratio": ratios,
        "llama_cpp_batch1": peer,
        "int8_vs_float32": int8_table,
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    if args.plot:
        threads = torch.get_num_threads()
        title = f"plain greedy decoding, {args.model}, {args.new_tokens} new tokens, {threads} threads"
        plot_decode_speed(result, args.plot, title)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
