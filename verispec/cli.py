"""`verispec generate | bench | audit | serve | draft-vocab`. User errors: one line on stderr and exit code 2, never a
traceback."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from verispec import LLM, SamplingParams, __version__, progress
from verispec.audit import ALPHA, format_table, run_audit
from verispec.bench import run_bench
from verispec.engine.args import EngineArgs
from verispec.loader.checkpoint import load_tokenizer
from verispec.proposers.draft_vocab import rank_vocab, write_vocab_file
from verispec.server.cli import add_serve_args, run_server


class _Parser(argparse.ArgumentParser):
    # argparse already exits 2; keep it to one line
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fail(msg: str) -> int:
    print(f"verispec: error: {msg}", file=sys.stderr)
    return 2


def cmd_generate(args: argparse.Namespace) -> int:

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    sp = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    if llm.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer (tokenizer.json): a text prompt cannot be encoded")
    if args.chat:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
    else:
        text, ids = args.prompt, llm.tokenizer.encode(args.prompt)
    engine = llm.engine
    engine.add_request("cli", text, ids, sp)
    printed = 0
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        # stream tokens as they are produced (several per step when speculating)
        for out in engine.step():
            tokens = len(out.outputs[0].token_ids)
            new = out.outputs[0].text[printed:]
            if new:
                sys.stdout.write(new)
                sys.stdout.flush()
                printed += len(new)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(_summary(tokens, time.perf_counter() - start, engine), file=sys.stderr)
    return 0


def _summary(tokens: int, seconds: float, engine) -> str:
    """One line: tokens, tok/s (prefill included), and what speculation drafted and accepted."""
    line = f"{tokens} tokens in {seconds:.2f} s, {tokens / max(seconds, 1e-9):.1f} tok/s"
    if engine.speculative_config is None:
        return line + ", speculation off"
    s = engine.counters.spec
    return (
        f"{line}, drafted {s.num_draft_tokens} / accepted {s.num_accepted_tokens}, "
        f"mean acceptance length {s.mean_acceptance_length:.2f}"
    )


def cmd_audit(args: argparse.Namespace) -> int:

    engine = EngineArgs.from_cli_args(args)
    rows = run_audit(
        engine,
        args.prompts,
        args.samples,
        args.temperature,
        args.top_p,
        args.max_tokens,
        progress=progress.enabled(),
    )
    print(format_table(rows))
    failed = next((r for r in rows if r.failed), None)
    if failed is not None:
        print(f"verispec audit: FAIL ({failed.check}, {failed.setting}): {failed.detail}", file=sys.stderr)
        return 1
    # a configuration lossy by design never gets here: its "output law" row fails
    print(f"verispec audit: pass (sampled test at alpha {ALPHA:g})", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:

    engine = EngineArgs.from_cli_args(args)
    run_bench(
        engine,
        args.workload,
        args.num_prompts,
        args.batch_size,
        args.max_tokens,
        args.output,
        args.temperature,
        progress=progress.enabled(),
        plot=args.plot,
    )
    return 0


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    """A draft_vocab_file from text like what the model will write: its ids, most frequent first, then the lowest
    others."""
    if args.size < 1:
        raise ValueError(f"--size must be at least 1, got {args.size}")
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise ValueError(f"no such file: {', '.join(missing)}")
    tok = load_tokenizer(args.model)
    try:
        text = [Path(f).read_text(encoding="utf-8", errors="replace") for f in args.files]
    except OSError as e:
        raise ValueError(f"cannot read {e.filename}: {e.strerror}") from None
    corpus = np.array([i for t in text for i in tok.encode(t, add_special_tokens=False)], dtype=np.int64)
    ids = rank_vocab(corpus, args.size, tok.vocab_size)
    try:
        write_vocab_file(args.output, ids)
    except OSError as e:
        raise ValueError(f"cannot write {args.output}: {e.strerror}") from None
    seen = min(int(np.unique(corpus).size), ids.size)
    print(
        f"{args.output}: {ids.size} ids, {seen} of them from {corpus.size} tokens in {len(args.files)} files"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:

    parser = _Parser(prog="verispec", description="Speculative-decoding LLM engine configured like vLLM")
    parser.add_argument("--version", action="version", version=f"verispec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate a completion and stream it to stdout")
    EngineArgs.add_cli_args(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="speculative vs plain decoding on a built-in workload, side by side")
    EngineArgs.add_cli_args(b)
    b.add_argument(
        "--workload", default="code-edit", help="code-edit | summarize | chat | repeat-edit | json-records"
    )
    b.add_argument("--num-prompts", type=int, default=8)
    b.add_argument("--batch-size", type=int, default=1)
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--output", default=None, help="write JSON results here")
    b.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="draw speedup and per-position acceptance to PATH (.png, .svg or .pdf; pip install 'verispec[plot]')",
    )
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=cmd_bench)
    a = sub.add_parser(
        "audit",
        help="check that speculation is lossless on this model and configuration",
        description="Greedy equality with and without speculation, and a chi-square test of the sampled law. "
        "Exit 0: pass; 1: a check failed (the first differing prompt and position are named); 2: bad arguments.",
    )
    EngineArgs.add_cli_args(a)
    a.add_argument(
        "--prompts",
        default=None,
        help='file, one prompt per line; a line starting with { or [ is JSON: {"prompt": ...}, '
        '{"messages": [...]} or a list of chat messages (chat template applied). Default: built-in prompts',
    )
    a.add_argument("--samples", type=int, default=400, help="sampled generations per prompt (0: greedy only)")
    a.add_argument("--temperature", type=float, default=1.0, help="of the sampled test (0: greedy only)")
    a.add_argument("--top-p", type=float, default=1.0)
    a.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    a.add_argument("--quiet", action="store_true", help="no progress bars")
    a.set_defaults(func=cmd_audit)
    v = sub.add_parser(
        "draft-vocab",
        help="write a draft_vocab_file from text like what the model will write",
        description="The ids the files hold under the model's tokenizer, most frequent first, then the lowest "
        "others, --size in all, as little-endian int32 (speculative_config.draft_vocab_file of a draft_model).",
    )
    v.add_argument("model", help="the draft model: a named model, a .gguf file or an HF folder")
    v.add_argument("files", nargs="+", help="text files (read as UTF-8)")
    v.add_argument("--size", type=int, required=True, help="token ids to keep")
    v.add_argument("-o", "--output", required=True, help="the file to write")
    v.set_defaults(func=cmd_draft_vocab)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(s)
    s.set_defaults(func=run_server)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # bars on stderr only on a terminal, and none at all (the model loader's too) with --quiet
    progress.set_quiet(getattr(args, "quiet", False))
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
