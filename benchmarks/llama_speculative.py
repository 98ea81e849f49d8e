"""llama.cpp's own draft-model speculation beside verispec's `draft_model`, on the same GGUF pair, prompts and
threads: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B by default.

    python benchmarks/llama_speculative.py --output bench_results/llama_speculative.json

llama.cpp's side is `llama-speculative-simple` (its `common_speculative` drafting, the one llama-server runs), built
with CMake from the llama.cpp sources that the llama-cpp-python 0.3.36 sdist vendors (downloaded from PyPI; the first
run compiles for ~10 minutes on 2 cores, then the binary is reused from --build-dir). It runs once per prompt and
reports its prompt and decode times; end to end = tokens / (prompt + decode), load excluded on both sides. Greedy;
verispec's code-edit workload (chat template applied, the text handed to llama.cpp, which tokenizes it itself: the
counts are checked). Benchmarks only, never CI.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from adaptive_k import cpu_model

from verispec import LLM, SamplingParams
from verispec.loader.checkpoint import resolve_model_path
from verispec.workloads import build_workload, chat_prompt_ids

ROOT = Path(__file__).resolve().parents[1]
SDIST = "llama-cpp-python==0.3.36"
BINARY = "llama-speculative-simple"


def build(build_dir: Path) -> Path:
    """The llama.cpp binary, compiled from the sdist's vendored sources on first use."""
    binary = build_dir / "build" / "bin" / BINARY
    if binary.is_file():
        return binary
    build_dir.mkdir(parents=True, exist_ok=True)
    pip = [
        sys.executable,
        "-m",
        "pip",
        "download",
        SDIST,
        "--no-binary",
        ":all:",
        "--no-deps",
        "-d",
        str(build_dir),
    ]
    subprocess.run(pip, check=True)
    sdist = next(build_dir.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(build_dir, filter="data")
    src = next(build_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    flags = "-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF"
    flags += (
        " -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DBUILD_SHARED_LIBS=OFF"
    )
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir / "build"), *flags.split()], check=True)
    subprocess.run(["cmake", "--build", str(build_dir / "build"), "--target", BINARY, "-j", "2"], check=True)
    return binary


def run_llama(binary: Path, target: Path, draft: Path, text: str, args, draft_max: int) -> dict:
    cmd = [str(binary), "-m", str(target), "-md", str(draft), "-p", text, "-n", str(args.max_tokens)]
    cmd += ["--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max)]
    cmd += ["-t", str(args.threads), "-td", str(args.threads), "--temp", "0"]
    # --no-repack: the AMX repacked buffers of this build die with SIGILL on this model (as the peer's
    # llama-cpp-python does without use_extra_bufts, benchmarks/llama_cpp_peer.py)
    cmd += ["-c", "4096", "-s", "1", "--no-repack"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    log = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"{BINARY} failed ({out.returncode}):\n{log[-3000:]}")

    def grab(pattern: str) -> float:
        m = re.search(pattern, log)
        if m is None:
            raise SystemExit(f"{BINARY}: no {pattern!r} in its output:\n{log[-3000:]}")
        return float(m.group(1))

    return {
        "prompt_tokens": int(grab(r"encoded\s+(\d+) tokens")),
        "prompt_s": grab(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds"),
        "tokens": int(grab(r"decoded\s+(\d+) tokens")),
        "decode_s": grab(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds"),
        "drafted": int(grab(r"n_drafted = (\d+)")),
        "accepted": int(grab(r"n_accept\s+= (\d+)")),
    }


def run_verispec(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    outs, seconds = [], 0.0
    for p in prompts:
        t = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        seconds += time.perf_counter() - t
        outs.append(o.outputs[0].token_ids)
    stats = llm.engine.counters.spec
    n = sum(len(o) for o in outs)
    row = {"tokens": n, "seconds": seconds, "tok_s": n / seconds}
    if stats is not None:
        row |= {"drafted": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens}
    return row, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="verispec's num_speculative_tokens (the planner's cap)")
    ap.add_argument(
        "--draft-n-max", default="3,4,8", help="llama.cpp's --spec-draft-n-max values (3: its default)"
    )
    ap.add_argument("--activation-dtype", default="int8", choices=("float32", "int8"))
    ap.add_argument("--build-dir", default=str(ROOT / "bench_results" / "llama.cpp"))
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    target, draft = resolve_model_path(args.model), resolve_model_path(args.draft)
    binary = build(Path(args.build_dir))
    kw = dict(
        max_model_len=4096, max_num_seqs=1, activation_dtype=args.activation_dtype, threads=args.threads
    )
    plain = LLM(args.model, **kw)
    prompts = chat_prompt_ids(plain.tokenizer, build_workload("code-edit", args.num_prompts))
    texts = [plain.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    rows = {}
    rows["verispec plain"], ref = run_verispec(plain, prompts, args.max_tokens)
    del plain
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k}
    rows["verispec draft_model"], outs = run_verispec(
        LLM(args.model, speculative_config=spec, **kw), prompts, args.max_tokens
    )
    identical = sum(a == b for a, b in zip(outs, ref))
    for dm in [int(x) for x in args.draft_n_max.split(",")]:
        runs = [run_llama(binary, target, draft, t, args, dm) for t in texts]
        n, s = sum(r["tokens"] for r in runs), sum(r["prompt_s"] + r["decode_s"] for r in runs)
        rows[f"llama.cpp draft-n-max {dm}"] = {
            "tokens": n,
            "seconds": s,
            "tok_s": n / s,
            "drafted": sum(r["drafted"] for r in runs),
            "accepted": sum(r["accepted"] for r in runs),
            "prompt_tokens": [r["prompt_tokens"] for r in runs],
        }
    base = rows["verispec plain"]["tok_s"]
    cpu = cpu_model()
    print(
        f"{args.model} + draft {args.draft}, code-edit x {len(prompts)}, {args.max_tokens} tokens, greedy, batch 1"
    )
    print(f"{args.threads} threads, verispec activation_dtype={args.activation_dtype}, {cpu}")
    print(f"{'config':>26}  {'tok/s':>7}  {'x plain':>7}  {'accepted / drafted':>18}")
    for name, r in rows.items():
        acc = f"{r['accepted']} / {r['drafted']}" if "drafted" in r else "-"
        print(f"{name:>26}  {r['tok_s']:>7.2f}  {r['tok_s'] / base:>7.2f}  {acc:>18}")
    print(f"verispec draft_model outputs identical to plain: {identical}/{len(prompts)}")
    lens = [len(p) for p in prompts]
    print(
        f"prompt tokens verispec {lens}, llama.cpp {rows[next(k for k in rows if k.startswith('llama'))]['prompt_tokens']}"
    )
    if args.output:
        out = {"cpu": cpu, "args": vars(args), "rows": rows, "identical": identical, "prompt_tokens": lens}
        Path(args.output).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
