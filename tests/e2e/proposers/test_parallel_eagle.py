"""P-EAGLE (`parallel_drafting` with eagle / eagle3): a chain of K drafts from one draft forward over the catch-up
rows and K - 1 masked rows (the mask token, the learned `mask_hidden` state). Lossless like every method; the
drafts are the ones the layout defines (draft 1 is EAGLE's own, the masked rows read `mask_hidden`)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests import helpers
from verispec import LLM, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
FIXTURES = {"eagle": "tiny_peagle", "eagle3": "tiny_peagle3"}


def _llm(target: str, method: str, draft: str, k: int, parallel: bool = True, **spec) -> LLM:
    cfg = {"method": method, "model": draft, "num_speculative_tokens": k, "parallel_drafting": parallel}
    return LLM(target, max_model_len=256, max_num_seqs=16, speculative_config=cfg | spec)


def _record_drafts(llm: LLM) -> dict[tuple[int, int], list[int]]:
    """(prompt length, position of the newest token) -> the drafts proposed there, for every later step."""
    seen: dict[tuple[int, int], list[int]] = {}
    proposer = llm.engine.proposer
    propose = proposer.propose

    def wrapped(reqs, k_max):
        out = propose(reqs, k_max)
        for r, d in zip(reqs, out.token_ids):
            if d:
                seen[(r.num_prompt, r.num_computed)] = list(d)
        return out

    proposer.propose = wrapped
    return seen


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 4])
def test_parallel_eagle_greedy_equality(request, tiny_llama, method, k, batch):
    draft = request.getfixturevalue(FIXTURES[method])
    prompts = helpers.prompts(batch, seed=batch)
    expected = LLM(tiny_llama, max_model_len=256).generate(prompts, SP, use_tqdm=False)
    llm = _llm(tiny_llama, method, draft, k, enable_adaptive_verification=False)
    assert llm.engine.proposer.mask_token == 3
    outs = llm.generate(prompts, SP, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert llm.engine.counters.spec.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_one_draft_forward_a_step(request, tiny_llama, method):
    """Every draft of a step comes from one forward of the draft model (EAGLE runs one per draft)."""
    draft = request.getfixturevalue(FIXTURES[method])
    llm = _llm(tiny_llama, method, draft, 4, enable_adaptive_verification=False)
    proposer = llm.engine.proposer
    calls, steps = [0], [0]
    forward, propose = proposer.draft.forward, proposer.propose

    def counted_forward(*a, **kw):
        calls[0] += 1
        return forward(*a, **kw)

    def counted_propose(reqs, k_max):
        steps[0] += max(k_max, default=0) > 0
        return propose(reqs, k_max)

    proposer.draft.forward, proposer.propose = counted_forward, counted_propose
    llm.generate(helpers.prompts(2), SP, use_tqdm=False)
    assert steps[0] > 0 and calls[0] == steps[0]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_first_draft_is_eagles_and_the_masked_rows_read_mask_hidden(request, tiny_llama, tmp_path, method):
    """Draft 1 sits at the catch-up's last row, before any masked row (causal): the autoregressive drafter's first
    draft at the same position. The later drafts come from the masked rows: another `mask_hidden` changes them."""
    draft = request.getfixturevalue(FIXTURES[method])
    prompts = helpers.prompts(3, seed=7)

    def drafts_of(folder: str, parallel: bool) -> dict:
        llm = _llm(tiny_llama, method, folder, 4, parallel, enable_adaptive_verification=False)
        seen = _record_drafts(llm)
        llm.generate(prompts, SP, use_tqdm=False)
        return seen

    par, seq = drafts_of(draft, True), drafts_of(draft, False)
    common = sorted(set(par) & set(seq))
    assert len(common) >= 3
    assert all(par[p][0] == seq[p][0] for p in common)
    assert any(par[p][1:] != seq[p][1:] for p in common)
    other = tmp_path / "other"
    shutil.copytree(draft, other)
    mask = load_file(str(other / "mask.safetensors"))["mask_hidden"]
    save_file({"mask_hidden": -3 * mask}, str(other / "mask.safetensors"))
    moved = drafts_of(str(other), True)
    both = sorted(set(par) & set(moved))
    assert all(par[p][0] == moved[p][0] for p in both)
    assert any(par[p][1:] != moved[p][1:] for p in both)


def test_drafts_do_not_depend_on_the_batch(tiny_llama, tiny_peagle3):
    """A request's masked rows sit behind its own catch-up rows whatever else is in the step."""
    prompts = helpers.prompts(4, seed=3)
    alone: dict = {}
    for p in prompts:
        llm = _llm(tiny_llama, "eagle3", tiny_peagle3, 3, enable_adaptive_verification=False)
        seen = _record_drafts(llm)
        llm.generate([p], SP, use_tqdm=False)
        alone |= seen
    llm = _llm(tiny_llama, "eagle3", tiny_peagle3, 3, enable_adaptive_verification=False)
    together = _record_drafts(llm)
    llm.generate(prompts, SP, use_tqdm=False)
    assert len({n for n, _ in alone}) == len(prompts), "the prompts' lengths tell them apart"
    assert together == alone


def test_sampled_law_is_the_targets(tiny_llama, tiny_peagle):
    llm = _llm(tiny_llama, "eagle", tiny_peagle, 3, rejection_sample_method="probabilistic")
    helpers.assert_second_token_law(llm)


def _edited(source: str, folder: Path, drop_mask: bool = False, config: dict | None = None, mask=None) -> str:
    shutil.copytree(source, folder)
    if drop_mask:
        (folder / "mask.safetensors").unlink()
    if mask is not None:
        save_file({"mask_hidden": mask}, str(folder / "mask.safetensors"))
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(
            json.dumps({k: v for k, v in {**cfg, **config}.items() if v is not None})
        )
    return str(folder)


def test_parallel_eagle_errors(tiny_llama, tiny_peagle, tiny_peagle3, tmp_path):
    import torch

    no_mask = _edited(tiny_peagle, tmp_path / "a", drop_mask=True)
    with pytest.raises(
        ValueError, match="mask_hidden not found in weights but model is configured for parallel"
    ):
        _llm(tiny_llama, "eagle", no_mask, 3)
    no_token = _edited(tiny_peagle3, tmp_path / "b", config={"mask_token_id": None})
    with pytest.raises(
        ValueError, match="must have `dflash_config.mask_token_id`, `mask_token_id`, `dspark_noise"
    ):
        _llm(tiny_llama, "eagle3", no_token, 3)
    wrong = _edited(tiny_peagle3, tmp_path / "c", mask=torch.zeros(1, 7))
    with pytest.raises(ValueError, match="'mask_hidden' must hold .* floats"):
        _llm(tiny_llama, "eagle3", wrong, 3)
    with pytest.raises(ValueError, match="parallel_drafting with method 'eagle' .* speculative_token_tree"):
        _llm(tiny_llama, "eagle", tiny_peagle, 2, speculative_token_tree="[(0,), (1,), (0, 0)]")
    with pytest.raises(ValueError, match="parallel_drafting is only compatible"):
        LLM(
            tiny_llama,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "parallel_drafting": True},
        )


def test_mask_hidden_without_parallel_drafting_is_skipped_with_a_warning(tiny_llama, tiny_peagle, caplog):
    with caplog.at_level(logging.WARNING):
        llm = _llm(tiny_llama, "eagle", tiny_peagle, 2, parallel=False)
    assert "Skipping loading mask_hidden" in caplog.text
    assert llm.engine.proposer.mask_token is None and llm.engine.proposer.draft.mask_hidden is None
