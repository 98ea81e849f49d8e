"""Speculative vs plain decoding, side by side in one run, plus the peers (--peer, batch 1): transformers' and
llama.cpp's (benchmarks/llama_cpp_peer.py, if installed) greedy and prompt lookup decoding.

    .venv/bin/python benchmarks/spec_decode.py --workload code-edit --batch-size 1 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'

Prints one table (tokens, drafts, acceptance, tok/s, speedup) and writes JSON to bench_results/.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import llama_cpp_peer
import torch
from adaptive_k import cpu_model, device_name, variants

from verispec.bench import BenchResult, print_table, time_llm
from verispec.loader.checkpoint import resolve_model_path
from verispec.sampling_params import SamplingParams
from verispec.workloads import WORKLOADS, build_workload, chat_prompt_ids


def transformers_run(
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    eos: int,
    lookup: int | None,
    hf=None,
    dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),
) -> tuple[BenchResult, list[list[int]], object]:
    """Greedy HF generate, one prompt at a time (prompt lookup decoding supports batch 1 only), in the dtype and on
    the device verispec runs in."""
    if hf is None:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(model)
        kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent if kw else path), dtype=dtype, **kw)
        hf = hf.to(device).eval()
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    outs, n = [], 0
    with torch.inference_mode():
        hf.generate(
            torch.tensor([prompts[0][:8]], device=hf.device),
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=eos,
        )
        t = time.perf_counter()
        for p in prompts:
            o = hf.generate(
                torch.tensor([p], device=hf.device),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
                **extra,
            )
            outs.append(o[0, len(p) :].tolist())
            n += len(outs[-1])
        dt = time.perf_counter() - t
    label = f"transformers{' prompt-lookup' if lookup else ''}"
    return BenchResult(label, dt, n, n / dt), outs, hf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workload", default="code-edit", choices=WORKLOADS)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--speculative-config",
        "-sc",
        action="append",
        default=None,
        help="JSON; repeat to compare several methods in the same run",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="serve the workload this many times (suffix learns)"
    )
    ap.add_argument(
        "--peer",
        action="store_true",
        help="also run transformers and llama.cpp (if installed), greedy and prompt lookup (batch 1)",
    )
    ap.add_argument("--peer-lookup", type=int, default=4, help="drafts per step of the peers' prompt lookup")
    ap.add_argument("--peer-ngram", type=int, default=2, help="llama.cpp prompt lookup's max_ngram_size")
    ap.add_argument(
        "--fixed-k",
        default=None,
        help="e.g. 1,2,4,8: each config runs with the goodput planner and then with each fixed K "
        "(benchmarks/adaptive_k.py sweeps workloads, batch sizes and temperatures the same way)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled runs are seeded; 0 = greedy")
    ap.add_argument(
        "--activation-dtype", default="float32", choices=("float32", "int8"), help="verispec's rows"
    )
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the model runs")
    ap.add_argument("--output", default=None)
    ap.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="draw speedup per row and per-position acceptance to PATH (.png / .svg / .pdf; needs matplotlib)",
    )
    args = ap.parse_args()
    from verispec import LLM
    from verispec.plot import check_plot_path, plot_spec_decode

    if args.plot:
        try:
            check_plot_path(args.plot)
        except ValueError as e:
            ap.error(str(e))

    specs = [
        json.loads(s)
        for s in (
            args.speculative_config
            or ['{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}']
        )
    ]
    if args.fixed_k:
        fixed = [int(k) for k in args.fixed_k.split(",") if k.strip()]
        specs = [config for spec in specs for _, config in variants(spec, fixed, "")]
    kw = dict(
        max_num_seqs=args.batch_size,
        max_model_len=2048,
        activation_dtype=args.activation_dtype,
        device=args.device,
    )
    plain = LLM(args.model, **kw)
    tok = plain.tokenizer
    # the peers run in verispec's dtype, on its device (bfloat16 on CUDA)
    weight = plain.ckpt.model.embed_tokens.weight
    model_dtype, model_device = weight.dtype, weight.device
    convs = build_workload(args.workload, args.num_prompts)
    if tok.chat_template:
        prompts = chat_prompt_ids(tok, convs)
    else:
        # a model without a chat template (the gemma3-270m GGUF) reads the request's text as a plain prompt
        print(f"{args.model} has no chat template: the workload's requests are plain-text prompts")
        prompts = [tok.encode(c[-1]["content"]) for c in convs]
    prompts = prompts * args.rounds
    sp = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=0 if args.temperature else None
    )
    base, base_outs = time_llm(plain, prompts, sp, "verispec plain", batch=args.batch_size)
    ref = [o.outputs[0].token_ids for o in base_outs]
    rows, identical = [base], {}
    del plain
    for spec in specs:
        llm = LLM(args.model, speculative_config=spec, **kw)
        label = "verispec " + spec.get("method", str(spec.get("model")))
        if "enable_adaptive_verification" in spec:
            adaptive = spec["enable_adaptive_verification"]
            label += " planner" if adaptive else f" K={spec.get('num_speculative_tokens')}"
        if "speculative_token_tree" in spec:
            label += " tree"
        # two configs of one method: each row keeps its own count
        if label in identical:
            label += f" #{sum(k.startswith(label) for k in identical) + 1}"
        res, outs = time_llm(llm, prompts, sp, label, batch=args.batch_size)
        rows.append(res)
        identical[label] = sum(o.outputs[0].token_ids == r for o, r in zip(outs, ref))
        del llm
    if args.peer and args.batch_size == 1:
        eos = tok.eos_token_ids[0]
        hf_plain, hf_outs, hf = transformers_run(
            args.model, prompts, args.max_tokens, eos, None, None, model_dtype, model_device
        )
        hf_pld, pld_outs, _ = transformers_run(
            args.model, prompts, args.max_tokens, eos, args.peer_lookup, hf
        )
        rows += [hf_plain, hf_pld]
        identical["transformers"] = sum(a == b for a, b in zip(hf_outs, ref))
        identical["transformers prompt-lookup"] = sum(a == b for a, b in zip(pld_outs, ref))
        # speculation against each peer's own plain decoding
        peer_outs = {"transformers": hf_outs}
        identical["transformers prompt-lookup vs transformers"] = sum(
            a == b for a, b in zip(pld_outs, hf_outs)
        )
        if llama_cpp_peer.available() and resolve_model_path(args.model).suffix == ".gguf":
            for label, lookup in (("llama.cpp", None), ("llama.cpp prompt-lookup", args.peer_lookup)):
                model = llama_cpp_peer.load(
                    resolve_model_path(args.model), torch.get_num_threads(), lookup, args.peer_ngram
                )
                dt, outs = llama_cpp_peer.run(model, prompts, args.max_tokens, set(tok.eos_token_ids))
                n = sum(len(o) for o in outs)
                rows.append(BenchResult(label, dt, n, n / dt))
                identical[label] = sum(a == b for a, b in zip(outs, ref))
                if lookup:
                    identical[f"{label} vs llama.cpp"] = sum(
                        a == b for a, b in zip(outs, peer_outs["llama.cpp"])
                    )
                peer_outs[label] = outs
                del model
        else:
            print("llama.cpp peer skipped: llama-cpp-python is not installed (benchmarks/llama_cpp_peer.py)")
    print(
        f"CPU: {cpu_model()}, {device_name(args.device)}\nmodel={args.model} workload={args.workload} prompts={len(prompts)} "
        f"batch={args.batch_size} max_tokens={args.max_tokens} temperature={args.temperature} "
        f"threads={torch.get_num_threads()}"
    )
    print_table(rows, base)
    print(
        "identical greedy outputs vs verispec plain: "
        + ", ".join(f"{k} {v}/{len(prompts)}" for k, v in identical.items())
    )
    out = Path(args.output or f"bench_results/spec_decode_{args.workload}_b{args.batch_size}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": vars(args), "rows": [asdict(r) for r in rows], "identical": identical}, indent=2)
    )
    if args.plot:
        title = (
            f"{args.model}, {args.workload}, {len(prompts)} prompts, batch {args.batch_size}, "
            f"max_tokens {args.max_tokens}, T={args.temperature:g}\n{cpu_model()}, {torch.get_num_threads()} threads"
        )
        plot_spec_decode([asdict(r) for r in rows], args.plot, title)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
