"""`dspark` end to end on a tiny Qwen3DSparkModel checkpoint: lossless for every layout and option, the drafts the
Markov head picks, the confidence head's estimates handed to the planner and its threshold, detection and errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests import helpers
from tests.tiny_models import write_tiny_dspark
from verispec import LLM, SamplingParams
from verispec.proposers.base import Proposal

SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _llm(target: str, draft: str, k: int = 4, **spec) -> LLM:
    cfg = {"method": "dspark", "model": draft, "num_speculative_tokens": k} | spec
    return LLM(target, max_model_len=256, max_num_seqs=16, speculative_config=cfg)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=256)

    def run(prompts):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, SP, use_tqdm=False)]

    return run


@pytest.fixture(scope="module")
def variants(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """DSpark checkpoints with each option: no confidence head, the bonus-anchor layout, top-k bias, no Markov head."""
    root, target = tmp_path_factory.mktemp("dspark_variants"), Path(tiny_llama)
    return {
        "no_confidence": str(write_tiny_dspark(root / "a", target, confidence=False)),
        "bonus_anchor": str(write_tiny_dspark(root / "b", target, dspark_bonus_anchor=True)),
        "topk": str(write_tiny_dspark(root / "c", target, dspark_draft_topk=5)),
        "no_markov": str(write_tiny_dspark(root / "d", target, markov_rank=0, with_markov=False)),
    }


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equality(tiny_llama, tiny_dspark, plain, k, batch):
    prompts = helpers.prompts(batch, seed=batch)
    llm = _llm(tiny_llama, tiny_dspark, k, enable_adaptive_verification=False)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, SP, use_tqdm=False)] == plain(prompts)
    assert llm.engine.counters.spec.num_draft_tokens > 0


@pytest.mark.parametrize("variant", ["no_confidence", "bonus_anchor", "topk", "no_markov"])
def test_every_layout_and_option_is_lossless(tiny_llama, variants, plain, variant):
    prompts = helpers.prompts(3, seed=5)
    k = 5 if variant == "bonus_anchor" else 6
    llm = _llm(tiny_llama, variants[variant], k, dspark_confidence_threshold=0.0)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, SP, use_tqdm=False)] == plain(prompts)


def _proposals(llm: LLM) -> list[Proposal]:
    seen = []
    proposer = llm.engine.proposer
    propose = proposer.propose

    def wrapped(reqs, k_max):
        out = propose(reqs, k_max)
        seen.append(out)
        return out

    proposer.propose = wrapped
    return seen


def test_the_markov_head_shapes_the_drafts(tiny_llama, tiny_dspark, variants):
    """The same backbone with and without its Markov head drafts differently (the bias moves the argmax)."""
    prompts = helpers.prompts(2, seed=9)
    firsts = []
    for draft in (tiny_dspark, variants["no_markov"]):
        llm = _llm(tiny_llama, draft, 4, enable_adaptive_verification=False)
        seen = _proposals(llm)
        llm.generate(prompts, SP, use_tqdm=False)
        firsts.append(seen[0].token_ids)
    assert firsts[0] != firsts[1]


def test_confidences_reach_the_planner_and_the_threshold_cuts_blocks(tiny_llama, tiny_dspark):
    prompts = helpers.prompts(2, seed=4)
    llm = _llm(tiny_llama, tiny_dspark, 6, enable_adaptive_verification=False)
    seen = _proposals(llm)
    llm.generate(prompts, SP, use_tqdm=False)
    full = llm.engine.counters.spec
    p = seen[0]
    assert p.confidence is not None
    assert all(len(c) == len(d) and all(0 < x < 1 for x in c) for c, d in zip(p.confidence, p.token_ids))
    cut = _llm(
        tiny_llama, tiny_dspark, 6, enable_adaptive_verification=False, dspark_confidence_threshold=0.5
    )
    seen = _proposals(cut)
    cut.generate(prompts, SP, use_tqdm=False)
    for prop in seen:
        for conf in prop.confidence:
            survival = 1.0
            for c in conf:
                survival *= c
                assert survival >= 0.5
    assert cut.engine.counters.spec.num_draft_tokens < full.num_draft_tokens


def test_detected_from_the_architecture_and_the_name(tiny_llama, tiny_dspark, tmp_path):
    llm = LLM(
        tiny_llama, max_model_len=256, speculative_config={"model": tiny_dspark, "num_speculative_tokens": 3}
    )
    assert llm.speculative_config.method == "dspark" and llm.speculative_config.parallel_drafting
    named = tmp_path / "my-dspark-draft"
    shutil.copytree(tiny_dspark, named)
    cfg = json.loads((named / "config.json").read_text())
    (named / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlashDraftModel"]}))
    llm = LLM(
        tiny_llama, max_model_len=256, speculative_config={"model": str(named), "num_speculative_tokens": 3}
    )
    assert llm.speculative_config.method == "dspark"


def _edit(source: str, folder: Path, drop: str | None = None, **config) -> str:
    shutil.copytree(source, folder)
    if drop is not None:
        (folder / drop).unlink()
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    return str(folder)


def test_errors_name_the_setting(tiny_llama, tiny_dspark, tmp_path):
    with pytest.raises(ValueError, match=r"block_size=6 \(the newest token first\): use at most 6"):
        _llm(tiny_llama, tiny_dspark, 7)
    omni = _edit(tiny_dspark, tmp_path / "a", architectures=["Qwen3OmniDSparkModel"])
    with pytest.raises(ValueError, match="Qwen3OmniDSparkModel draft; this build runs Qwen3 DSpark drafts"):
        _llm(tiny_llama, omni)
    gated = _edit(tiny_dspark, tmp_path / "b", markov_head_type="gated")
    with pytest.raises(ValueError, match="markov_head_type='gated'"):
        _llm(tiny_llama, gated)
    headless = _edit(tiny_dspark, tmp_path / "c", drop="heads.safetensors")
    with pytest.raises(
        ValueError, match="says markov_rank=8, but the checkpoint has no 'markov_head.markov_w1.weight'"
    ):
        _llm(tiny_llama, headless)
    with pytest.raises(ValueError, match="dspark_confidence_threshold is only supported by DSpark"):
        LLM(
            tiny_llama,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "dspark_confidence_threshold": 0.5,
            },
        )
    with pytest.raises(ValueError, match="dspark_confidence_threshold.* must be in \\[0, 1\\]"):
        _llm(tiny_llama, tiny_dspark, dspark_confidence_threshold=1.5)
