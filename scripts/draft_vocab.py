"""Write a draft-vocabulary file (`speculative_config.draft_vocab_file`) from text like what the model will write:
the ids those files hold under the model's tokenizer, most frequent first, then the lowest others, N in all.

    .venv/bin/python scripts/draft_vocab.py --model qwen2.5-coder-0.5b-instruct --size 32768 -o vocab.bin src/*.py

Files are read as UTF-8 text (undecodable bytes replaced). Exit code 2 with a message for a missing file or a size
below 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from verispec.loader.checkpoint import resolve_model_path
from verispec.loader.gguf import load_gguf
from verispec.proposers.draft_vocab import rank_vocab, write_vocab_file
from verispec.tokenizer import Tokenizer


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a model name, GGUF file or HF folder (no weights read)."""
    path = resolve_model_path(model)
    return load_gguf(path, with_tensors=False).tokenizer if path.is_file() else Tokenizer.from_hf_dir(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the draft model (a name, a GGUF file or a folder)")
    ap.add_argument("--size", type=int, required=True, help="token ids to keep")
    ap.add_argument("-o", "--output", required=True, help="where to write the ids (little-endian int32)")
    ap.add_argument("files", nargs="+", help="text files of the kind the model will write")
    args = ap.parse_args()
    if args.size < 1:
        ap.error(f"--size must be at least 1, got {args.size}")
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    tok = load_tokenizer(args.model)
    corpus = np.array(
        [i for f in args.files for i in tok.encode(Path(f).read_text(encoding="utf-8", errors="replace"))],
        dtype=np.int64,
    )
    ids = rank_vocab(corpus, args.size, tok.vocab_size)
    write_vocab_file(args.output, ids)
    seen = int(np.unique(corpus).size)
    print(
        f"{args.output}: {ids.size} ids ({min(seen, ids.size)} from {corpus.size} tokens of {len(args.files)} files)"
    )


if __name__ == "__main__":
    sys.exit(main())
