"""The real embedded model: SmolLM2-135M-Instruct (GGUF) greedy output equals transformers', with and without
speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import CHAT_PROMPTS
from verispec import LLM, SamplingParams

NEW = 24


@pytest.fixture(scope="module")
def smol(smollm2_gguf_path) -> LLM:
    return LLM(smollm2_gguf_path, max_model_len=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def smol_prompts(smol) -> list[list[int]]:
    tok = smol.tokenizer
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
        for p in CHAT_PROMPTS
    ]


@pytest.fixture(scope="module")
def smol_greedy(smol, smol_prompts) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=NEW)
    return [
        o.outputs[0].token_ids for o in smol.generate([{"prompt_token_ids": p} for p in smol_prompts], sp)
    ]


def test_greedy_matches_transformers(smollm2_gguf_path, smol_prompts, smol_greedy):
    from transformers import AutoModelForCausalLM

    path = Path(smollm2_gguf_path)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    for ids, ours in zip(smol_prompts, smol_greedy):
        with torch.inference_mode():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=2)
        # both stop after (and include) EOS
        assert out[0, len(ids) :].tolist() == ours


@pytest.mark.parametrize(
    "cfg",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
        {"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 3},
        {"method": "suffix", "num_speculative_tokens": 8},
    ],
    ids=["ngram", "self-draft", "suffix"],
)
def test_speculative_greedy_equality(smollm2_gguf_path, smol_prompts, smol_greedy, cfg):
    llm = LLM(smollm2_gguf_path, max_model_len=512, max_num_seqs=8, speculative_config=cfg)
    sp = SamplingParams(temperature=0, max_tokens=NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in smol_prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == smol_greedy
    if cfg["method"] == "draft_model":
        s = llm.engine.counters.spec
        # the model drafting for itself, its drafts in int8 activations and verified in float32: nearly always right
        assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens > 0


def test_suffix_warms_up_on_repeated_prompts(smollm2_gguf_path):
    """The same prompts served again and again: the global tree makes later rounds accept far more."""
    cfg = {"method": "suffix", "suffix_decoding_max_cached_requests": 1000}
    llm = LLM(smollm2_gguf_path, max_model_len=512, max_num_seqs=8, speculative_config=cfg)
    tok = llm.tokenizer
    topics = ["cats", "rain", "tea", "maps", "bees", "jazz", "salt", "kites", "moss", "owls"] * 2
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": f"One sentence about {t}."}]),
            add_special_tokens=False,
        )
        for t in topics
    ]
    sp = SamplingParams(temperature=0, max_tokens=24)
    rates = []
    for _ in range(10):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        rates.append(sum(o.num_accepted_tokens for o in outs) / max(1, sum(o.num_draft_tokens for o in outs)))
    assert rates[-1] > rates[0] and rates[-1] > 0.8, rates


@pytest.mark.parametrize("batch", [1, 8])
def test_suffix_greedy_equality_batches(smollm2_gguf_path, smol, batch):
    tok = smol.tokenizer
    topics = ["rivers", "clocks", "chess", "bread", "comets", "glass", "violins", "deserts"][:batch]
    prompts = [
        {
            "prompt_token_ids": tok.encode(
                tok.apply_chat_template([{"role": "user", "content": f"Describe {t}."}]),
                add_special_tokens=False,
            )
        }
        for t in topics
    ]
    sp = SamplingParams(temperature=0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in smol.generate(prompts, sp, use_tqdm=False)]
    llm = LLM(smollm2_gguf_path, max_model_len=512, max_num_seqs=8, speculative_config={"method": "suffix"})
    # the second round drafts from the global tree of the first
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
    assert llm.engine.counters.spec.num_accepted_tokens > 0
