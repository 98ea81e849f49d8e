"""A draft model whose LM head keeps part of the vocabulary (`draft_vocab_size`, `draft_vocab_file`): every draft
is a kept id, and the output is plain decoding's, greedy token for token and sampled in law."""

from __future__ import annotations

import numpy as np
import pytest

from tests import helpers
from verispec import LLM, SamplingParams
from verispec.cli import main
from verispec.layers.trimmed_head import TrimmedHead
from verispec.proposers.draft_vocab import read_vocab_file

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _spec(draft: str, **extra) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, **extra}


def _record_drafts(llm: LLM) -> list[int]:
    drafts: list[int] = []
    prop = llm.engine.proposer
    propose = prop.propose

    def recording(reqs, k_max):
        out = propose(reqs, k_max)
        drafts.extend(t for row in out.token_ids for t in row)
        return out

    prop.propose = recording
    return drafts


@pytest.mark.parametrize("activation_dtype", ["float32", "int8"])
def test_a_trimmed_draft_head_drafts_kept_ids_and_changes_nothing(tiny_gguf, tiny_llama, activation_dtype):
    """tiny_llama drafts for its own GGUF (a strong draft: most drafts accepted) with half its vocabulary kept."""
    prompts = {b: helpers.prompts(b, seed=b) for b in (1, 4)}
    kw = dict(max_model_len=256, max_num_seqs=4, activation_dtype=activation_dtype)
    plain = LLM(tiny_gguf, **kw)
    reference = {
        b: [o.outputs[0].token_ids for o in plain.generate(p, GREEDY, use_tqdm=False)]
        for b, p in prompts.items()
    }
    llm = LLM(tiny_gguf, speculative_config=_spec(tiny_gguf, draft_vocab_size=160), **kw)
    head = llm.engine.proposer.runner.model.lm_head
    assert isinstance(head, TrimmedHead)
    keep = set(head.keep.tolist())
    assert 160 <= len(keep) < llm.engine.runner.model.cfg.vocab_size
    drafts = _record_drafts(llm)
    for b, p in prompts.items():
        assert [o.outputs[0].token_ids for o in llm.generate(p, GREEDY, use_tqdm=False)] == reference[b]
    assert drafts and set(drafts) <= keep
    spec = llm.engine.counters.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_a_draft_vocabulary_file(tiny_llama, tmp_path):
    path = tmp_path / "draft_vocab.bin"
    ids = np.arange(0, 300, 3, dtype="<i4")
    ids.tofile(path)
    prompts = helpers.prompts(4, seed=3)
    plain = LLM(tiny_llama, max_model_len=256, max_num_seqs=4)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(
        tiny_llama,
        max_model_len=256,
        max_num_seqs=4,
        speculative_config=_spec(tiny_llama, draft_vocab_file=str(path)),
    )
    keep = set(llm.engine.proposer.runner.model.lm_head.keep.tolist())
    assert set(ids.tolist()) <= keep and len(keep) < 312
    drafts = _record_drafts(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference
    assert drafts and set(drafts) <= keep


def test_verispec_draft_vocab_writes_a_file_the_engine_reads(tiny_llama, tmp_path, capsys):
    """`verispec draft-vocab`: a corpus's ids, most frequent first, in a file draft_vocab_file takes; exit code 2 and
    one line for a missing corpus file, a size below 1, an unknown model or an output it cannot write."""
    text = tmp_path / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 3)
    out = tmp_path / "vocab.bin"
    assert main(["draft-vocab", tiny_llama, str(text), "--size", "64", "-o", str(out)]) == 0
    llm = LLM(tiny_llama, max_model_len=128, max_num_seqs=1)
    ids = read_vocab_file(str(out), llm.engine.runner.model.cfg.vocab_size)
    corpus = llm.tokenizer.encode(text.read_text(), add_special_tokens=False)
    assert ids.size == 64 and ids[0] == max(set(corpus), key=lambda i: (corpus.count(i), -i))
    assert set(corpus) <= set(ids.tolist())
    spec = LLM(
        tiny_llama,
        max_model_len=128,
        max_num_seqs=1,
        speculative_config=_spec(tiny_llama, draft_vocab_file=str(out)),
    )
    assert set(ids.tolist()) <= set(spec.engine.proposer.runner.model.lm_head.keep.tolist())
    capsys.readouterr()
    for argv, message in (
        ([tiny_llama, str(tmp_path / "nope.txt"), "--size", "8"], "no such file"),
        ([tiny_llama, str(text), "--size", "0"], "--size must be at least 1"),
        ([str(tmp_path / "no-model"), str(text), "--size", "8"], "not found"),
        ([str(tmp_path), str(text), "--size", "8"], "no tokenizer.json"),
        ([tiny_llama, str(text), "--size", "8", "-o", str(tmp_path / "no-dir" / "v.bin")], "cannot write"),
    ):
        argv = argv if "-o" in argv else [*argv, "-o", str(out)]
        assert main(["draft-vocab", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("rule", ["strict", "probabilistic"])
def test_sampled_output_follows_the_target_with_a_trimmed_draft_head(tiny_llama, rule):
    """The draft's q is zero outside the kept ids; the rejection sampler must still give the target's law."""
    llm = LLM(
        tiny_llama,
        max_model_len=64,
        max_num_seqs=16,
        seed=0,
        speculative_config=_spec(
            tiny_llama, draft_vocab_size=96, rejection_sample_method=rule, enable_adaptive_verification=False
        ),
    )
    helpers.assert_second_token_law(llm)


def test_the_key_is_refused_for_other_methods(tiny_llama):
    with pytest.raises(ValueError, match="draft_vocab_size trims a draft model's LM head"):
        LLM(
            tiny_llama,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "draft_vocab_size": 64},
        )


def test_a_missing_vocabulary_file_is_a_clear_error(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="speculative_config.draft_vocab_file .* cannot be read"):
        LLM(tiny_llama, speculative_config=_spec(tiny_llama, draft_vocab_file=str(tmp_path / "none.bin")))
