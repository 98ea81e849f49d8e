"""Cross-tokenizer drafting (`use_heterogeneous_vocab`, TLI): a draft model with its own vocabulary changes nothing
in the output (greedy token for token, sampled in law), and its drafts are the target's tokens under the map."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests import helpers
from tests.tiny_models import write_renamed_vocab_copy, write_sentencepiece_transplant, write_tiny_checkpoint
from verispec import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def hetero(draft: str, k: int = 3, **extra) -> dict:
    return {
        "method": "draft_model",
        "model": draft,
        "num_speculative_tokens": k,
        "use_heterogeneous_vocab": True,
        **extra,
    }


@pytest.fixture(scope="module")
def sp_draft(tiny_llama, tmp_path_factory) -> str:
    """tiny_llama's layers with a SentencePiece-style vocabulary of 512 ids (byte fallback, BOS): the rows of the
    tokens both vocabularies hold are the target's, so it often predicts the target's token, not always."""
    folder = tmp_path_factory.mktemp("sp") / "d"
    return str(write_sentencepiece_transplant(Path(tiny_llama), folder))


@pytest.fixture(scope="module")
def renamed_pair(tmp_path_factory) -> tuple[str, str]:
    """A target whose model rows are exactly its tokenizer's 312 tokens, and the same model with shuffled ids."""
    root = tmp_path_factory.mktemp("renamed")
    target = write_tiny_checkpoint(root / "t", "llama", seed=0, vocab_size=312)
    return str(target), str(write_renamed_vocab_copy(target, root / "d", seed=1))


def _greedy(llm: LLM, prompts: list[dict], sp: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("rule", ["strict", "probabilistic"])
def test_greedy_equality_with_another_tokenizer(tiny_llama, sp_draft, k, rule):
    prompts = {b: helpers.prompts(b, seed=b) for b in (1, 4)}
    plain = LLM(tiny_llama, max_model_len=256, max_num_seqs=4)
    reference = {b: _greedy(plain, p) for b, p in prompts.items()}
    llm = LLM(
        tiny_llama,
        max_model_len=256,
        max_num_seqs=4,
        speculative_config=hetero(sp_draft, k, rejection_sample_method=rule),
    )
    for b, p in prompts.items():
        assert _greedy(llm, p) == reference[b], f"k={k} batch={b}"
    spec = llm.engine.counters.spec
    # a poor draft: some drafts are accepted, not all
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_parallel_drafting_with_another_tokenizer(tiny_llama, sp_draft, tmp_path):
    """PARD and cross-tokenizer drafting together: one draft forward carries the re-spelled catch-up tokens and
    K - 1 mask tokens of the draft's own vocabulary; the output stays plain decoding's."""
    folder = tmp_path / "pard"
    shutil.copytree(sp_draft, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "pard_token": 7}))
    prompts = helpers.prompts(4, seed=5)
    reference = _greedy(LLM(tiny_llama, max_model_len=256, max_num_seqs=4), prompts)
    llm = LLM(
        tiny_llama,
        max_model_len=256,
        max_num_seqs=4,
        speculative_config=hetero(str(folder), 3, parallel_drafting=True),
    )
    assert _greedy(llm, prompts) == reference
    assert llm.engine.counters.spec.num_draft_tokens > 0
    # sampled drafts from each mask position's own q, verified by probabilistic: the target's law
    cfg = hetero(str(folder), 2, parallel_drafting=True, rejection_sample_method="probabilistic")
    llm = LLM(tiny_llama, max_model_len=64, max_num_seqs=64, speculative_config=cfg, seed=1234)
    helpers.assert_second_token_law(llm)
    assert llm.engine.counters.spec.num_accepted_tokens > 0


def test_the_same_model_under_other_ids_is_always_right(renamed_pair):
    """The target's own weights with shuffled token ids: mapped through the vocabularies it predicts exactly the
    target's tokens, so every draft is accepted. Without the key the same draft (same vocab_size) is read in the
    target's ids and almost never right, and the output is unchanged either way."""
    target, draft = renamed_pair
    prompts = helpers.prompts(4, seed=4)
    # every draft accepted needs a draft step and a verify step that round alike (batch-invariant kernels, CPU
    # and CUDA); the reference pins the CPU, so the runs it is compared with do too
    kw = dict(max_model_len=256, max_num_seqs=4, device="cpu")
    reference = _greedy(LLM(target, **kw), prompts)
    llm = LLM(target, speculative_config=hetero(draft), **kw)
    assert _greedy(llm, prompts) == reference
    spec = llm.engine.counters.spec
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    same_vocab = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    llm = LLM(target, speculative_config=same_vocab, **kw)
    assert _greedy(llm, prompts) == reference
    spec = llm.engine.counters.spec
    assert spec.num_accepted_tokens < 0.5 * spec.num_draft_tokens


def test_sampled_drafts_carry_their_exact_law(renamed_pair):
    """Sampled drafting with probabilistic verification: q, carried over to the target's ids, is the target's own
    p here, so p/q = 1 and (nearly) every sampled draft is accepted; a q on the wrong ids would be rejected."""
    target, draft = renamed_pair
    cfg = hetero(draft, 3, rejection_sample_method="probabilistic", draft_sample_method="probabilistic")
    llm = LLM(target, max_model_len=64, max_num_seqs=32, speculative_config=cfg, seed=3)
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    llm.generate(helpers.prompts(32, seed=5), sp, use_tqdm=False)
    spec = llm.engine.counters.spec
    assert spec.num_draft_tokens > 100
    assert spec.num_accepted_tokens >= 0.99 * spec.num_draft_tokens


@pytest.mark.parametrize(
    "rule, draft_sample", [("probabilistic", "probabilistic"), ("probabilistic", "greedy")]
)
def test_sampled_tokens_follow_target_distribution(tiny_llama, sp_draft, rule, draft_sample):
    """The second output token (the first one verification produced) follows the target's exact marginal with a
    draft of another vocabulary: sampled drafts with q carried over to the target's ids (zero on every target token
    outside the intersection), and argmax drafts (q one-hot, vLLM's only mode here)."""
    cfg = hetero(sp_draft, 2, rejection_sample_method=rule, draft_sample_method=draft_sample)
    llm = LLM(tiny_llama, max_model_len=64, max_num_seqs=64, speculative_config=cfg, seed=1234)
    helpers.assert_second_token_law(llm)
    spec = llm.engine.counters.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_a_context_too_long_for_the_draft_cache_gets_no_drafts(tiny_llama, sp_draft):
    """'Ġâ' (a space and a lone byte) is two tokens in the draft's vocabulary: 40 of them outgrow the draft's cache
    of max_model_len + lookahead positions, and that request decodes without drafts beside one that has them."""
    long = {"prompt_token_ids": [298] * 40}
    short = helpers.prompts(1, seed=9)[0]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = _greedy(LLM(tiny_llama, max_model_len=64, max_num_seqs=2), [short, long], sp)
    cfg = hetero(sp_draft, 3, rejection_sample_method="probabilistic")
    llm = LLM(tiny_llama, max_model_len=64, max_num_seqs=2, speculative_config=cfg)
    outs = llm.generate([short, long], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert outs[0].num_draft_tokens > 0 and outs[1].num_draft_tokens == 0


def test_errors_name_the_key(tiny_llama, sp_draft, tmp_path):
    same_vocab = {"method": "draft_model", "model": sp_draft, "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="draft_model needs the same vocabulary, or use_heterogeneous_vocab"):
        LLM(tiny_llama, max_model_len=64, speculative_config=same_vocab)
    bare = tmp_path / "bare"
    shutil.copytree(sp_draft, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="use_heterogeneous_vocab maps token strings .* has none"):
        LLM(tiny_llama, max_model_len=64, speculative_config=hetero(str(bare)))
    with pytest.raises(ValueError, match="use_heterogeneous_vocab only works with method='draft_model'"):
        LLM(tiny_llama, max_model_len=64, speculative_config={**hetero(sp_draft), "method": "ngram"})


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("VERISPEC_SLOW") != "1",
    reason="loads Gemma 3 and SmolLM2 twice (about a minute of CPU): set VERISPEC_SLOW=1 to run",
)
@pytest.mark.parametrize(
    "target, draft", [("gemma3-270m", "smollm2-135m-instruct"), ("smollm2-135m-instruct", "gemma3-270m")]
)
def test_real_models_across_tokenizers(target, draft, gemma3_gguf_file, smollm2_gguf_file):
    """Gemma 3 (SentencePiece, 262k ids) and SmolLM2 (GPT-2 byte-level, 49k ids) draft for each other, greedy equal
    to plain decoding. disable_by_batch_size=2: the batch's first two requests speculate, the last two decode
    plainly in the same steps and are the reference."""
    paths = {"gemma3-270m": str(gemma3_gguf_file), "smollm2-135m-instruct": str(smollm2_gguf_file)}
    cfg = hetero(paths[draft], 3, disable_by_batch_size=2)
    llm = LLM(paths[target], max_model_len=128, max_num_seqs=4, speculative_config=cfg)
    texts = ["The capital of France is", "def fibonacci(n):"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(texts + texts, sp, use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    assert ids[:2] == ids[2:]
    assert all(o.num_draft_tokens > 0 for o in outs[:2]) and all(o.num_draft_tokens == 0 for o in outs[2:])
    assert llm.engine.counters.spec.num_accepted_tokens > 0
