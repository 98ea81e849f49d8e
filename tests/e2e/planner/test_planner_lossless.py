"""The goodput planner in the engine: whatever lengths it picks, output equals plain decoding (greedy) and follows
the target's law (sampled); fixed K and the per-batch-size schedule do what they say; its figures are exported."""

from __future__ import annotations

import pytest

from tests import helpers
from verispec import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16)
    return [o.outputs[0].token_ids for o in llm.generate(helpers.prompts(16), GREEDY, use_tqdm=False)]


def _configs(tiny_draft):
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": 6},
        "draft_model": {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3},
    }


@pytest.mark.row_cost(0.03)
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_planned_lengths_keep_greedy_output(tiny_llama, tiny_draft, plain_outputs, method):
    """A verified row costs 3% of a plain step: the planner verifies some drafts and skips others."""
    cfg = _configs(tiny_draft)[method]
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    outs = llm.generate(helpers.prompts(16), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    planner, spec = llm.engine.planner, llm.engine.counters.spec
    assert planner is not None and spec.num_draft_tokens > 0
    assert 0 < planner.mean_chosen_k < cfg["num_speculative_tokens"]


@pytest.mark.row_cost(1.0)
def test_rows_as_costly_as_a_step_are_not_verified(tiny_llama, plain_outputs):
    """An extra row costs a whole plain step: no draft pays, only the periodic one-draft probes run."""
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    outs = llm.generate(helpers.prompts(16), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    spec = llm.engine.counters.spec
    assert spec.num_draft_tokens == spec.num_drafts
    assert llm.engine.planner.mean_chosen_k < 0.2


@pytest.mark.row_cost(1.0)
def test_an_idle_stretch_runs_plain_steps_without_the_drafter(tiny_llama):
    """Where no draft pays, most steps of the idle stretch are skipped: the drafter is not called for them, nothing
    is verified, and the output is plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    plain = LLM(tiny_llama, max_model_len=256, max_num_seqs=16).generate(
        helpers.prompts(16), params, use_tqdm=False
    )
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=_configs(None)["suffix"])
    eng = llm.engine
    calls, steps = [], []
    propose, decode = eng.proposer.propose, eng._decode
    eng.proposer.propose = lambda reqs, k: calls.append(len(steps)) or propose(reqs, k)
    eng._decode = lambda reqs: steps.append(len(reqs)) or decode(reqs)
    outs = llm.generate(helpers.prompts(16), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    # (the first IDLE_AFTER steps are planned, then at most one in IDLE_SKIP_MAX + 1)
    assert 0 < len(calls) < len(steps) / 2
    assert eng.counters.spec.num_draft_tokens == 0 and eng.planner.mean_chosen_k == 0.0


@pytest.mark.row_cost(0.001)
def test_planned_lengths_keep_the_target_law(tiny_llama, tiny_draft):
    """Sampled requests with the planner choosing lengths: the first verified token follows the target's law."""
    cfg = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 2}
    llm = LLM(tiny_llama, max_model_len=64, max_num_seqs=64, speculative_config=cfg, seed=1234)
    helpers.assert_second_token_law(llm)
    assert llm.engine.counters.spec.num_draft_tokens > 0


def test_fixed_k_drafts_every_position(tiny_llama, tiny_draft, plain_outputs):
    """enable_adaptive_verification false: no planner; every speculating step drafts K (less only near the end)."""
    cfg = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3}
    llm = LLM(
        tiny_llama,
        max_model_len=256,
        max_num_seqs=16,
        spec_token_budget=1024,
        speculative_config=cfg | {"enable_adaptive_verification": False},
    )
    outs = llm.generate(helpers.prompts(16), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    from verispec.planner.fixed import FixedPlanner

    assert isinstance(llm.engine.planner, FixedPlanner)
    spec = llm.engine.counters.spec
    assert spec.num_draft_tokens_per_pos[0] == spec.num_drafts
    assert spec.num_draft_tokens_per_pos[2] >= spec.num_drafts - 2 * 16
    assert "verispec:spec_decode_mean_chosen_k" not in {m.name for m in llm.get_metrics()}


@pytest.mark.parametrize("adaptive", [False, True])
def test_per_batch_size_schedule_caps_the_drafts(tiny_llama, plain_outputs, adaptive):
    """num_speculative_tokens_per_batch_size: 2 drafts at batch sizes 1-8, none from 9 (16 requests start at 16)."""
    cfg = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "num_speculative_tokens_per_batch_size": [[1, 8, 2], [9, 64, 0]],
        "enable_adaptive_verification": adaptive,
    }
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    outs = llm.generate(helpers.prompts(16), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    spec = llm.engine.counters.spec
    assert spec.num_draft_tokens_per_pos[2:] == [0, 0]
    # every request is decoded at batch 16 first: no drafts then, so fewer drafts than output tokens
    assert spec.num_drafts < 16 * GREEDY.max_tokens // 2
    schedule_off = {**cfg, "num_speculative_tokens_per_batch_size": [[1, 64, 0]]}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=schedule_off)
    llm.generate(helpers.prompts(4), GREEDY, use_tqdm=False)
    assert llm.engine.counters.spec.num_drafts == 0


def test_per_batch_size_schedule_gaps_take_the_previous_k_and_ks_are_clamped(tiny_llama, plain_outputs):
    """vLLM's application of the schedule: batch sizes 2..63 lie in a gap and take the K of [1, 1] (0: no drafts,
    not the num_speculative_tokens default); a range's K of 9 above num_speculative_tokens = 2 is clamped to 2."""
    base = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    base["enable_adaptive_verification"] = False
    gap = {**base, "num_speculative_tokens_per_batch_size": [[1, 1, 0], [64, 64, 2]]}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=gap)
    outs = llm.generate(helpers.prompts(16), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert llm.engine.counters.spec.num_drafts == 0
    clamped = {**base, "num_speculative_tokens_per_batch_size": [[1, 64, 9]]}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=clamped)
    outs = llm.generate(helpers.prompts(16), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    spec = llm.engine.counters.spec
    assert spec.num_drafts > 0 and len(spec.num_draft_tokens_per_pos) == 2


@pytest.mark.row_cost(None)
def test_real_profile_and_exported_figures(tiny_llama, tmp_path, monkeypatch):
    """The start-up profile on the real model (cached under VERISPEC_CACHE), and the planner's gauges."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=4, speculative_config=cfg)
    cost = llm.engine.planner.step_cost
    assert cost.rows[:4] == [1, 2, 3, 4] and all(s > 0 for s in cost.seconds)
    assert list((tmp_path / "step_cost").glob("*.json"))
    llm.generate(helpers.prompts(4), GREEDY, use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["verispec:spec_decode_mean_chosen_k"].value >= 0.0
    assert metrics["verispec:spec_decode_verified_row_cost"].value >= 0.0
    line = llm.engine.spec_log.maybe_log(force=True)
    assert line is None or "Planner: mean chosen K" in line


@pytest.mark.row_cost(0.1)
@pytest.mark.parametrize("batch", [1, 4])
def test_dynamic_tree_node_budget_keeps_greedy_output(tiny_llama, tiny_eagle, batch):
    """Dynamic trees under the planner: each step verifies the most confident nodes that pay (a prefix of the
    tree, fewer than num_draft_tokens when rows cost 10% of a step), and the output is plain decoding's."""
    cfg = {
        "method": "eagle",
        "model": tiny_eagle,
        "num_speculative_tokens": 3,
        "speculative_token_tree": "dynamic",
        "eagle_topk": 3,
        "num_draft_tokens": 8,
    }
    prompts = helpers.prompts(batch, seed=batch + 70)
    plain = LLM(tiny_llama, max_model_len=256, max_num_seqs=16)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    spec = llm.engine.counters.spec
    assert spec.num_draft_tokens > 0
    # 7 nodes per request and step without the budget
    assert spec.num_draft_tokens < 7 * spec.num_drafts
    assert 0 < llm.engine.planner.mean_chosen_k < 7


@pytest.mark.row_cost(0.03)
def test_a_closed_batch_waits_for_the_request_with_the_most_steps_left(tiny_llama):
    """Two requests with the same tokens left: the one whose drafts have been accepted (3 tokens a step) will end
    first, so its tokens are worth less than the other's, which the batch waits for."""
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    eng = LLM(tiny_llama, max_model_len=256, max_num_seqs=4, speculative_config=cfg).engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    fast, slow = (eng.add_request(rid, None, [1, 2, 3, 4], params) for rid in ("fast", "slow"))
    eng._admit()
    eng.closed = True
    # 31 tokens each (9 left): 30 decoded in 10 steps, and in 30
    for r, steps in ((fast, 10), (slow, 30)):
        r.output_token_ids = [5] * 31
        r.decode_steps = steps
    worth = eng._token_worth(eng.running, eng.running)
    assert worth is not None and worth[0] < 1.0 == worth[1]
    # at one rate the two would end together: every token worth 1, the open batch's plan
    fast.decode_steps = 30
    assert eng._token_worth(eng.running, eng.running) is None


@pytest.mark.row_cost(0.03)
def test_a_closed_batch_weighs_tokens_by_the_time_they_save(tiny_llama, plain_outputs):
    """LLM.generate runs a closed batch: with every end known (ignore_eos, max_tokens) the planner weighs each
    request's tokens (a request ahead of the others is worth less than 1); with EOS able to end a request, by the
    chance that the requests run to their limits (none ended early so far: likely); after many early ends it plans
    as for an open batch. Output equals plain decoding each time, and the engine is open again after."""
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    planner = llm.engine.planner
    seen: list[list[float] | None] = []
    choose = planner.choose

    def spy(*args, worth=None, **kw):
        seen.append(worth)
        return choose(*args, worth=worth, **kw)

    planner.choose = spy
    lengths = [8 + i for i in range(16)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(helpers.prompts(16), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [p[:n] for p, n in zip(plain_outputs, lengths)]
    worths = [w for w in seen if w is not None]
    assert worths and min(min(w) for w in worths) < 1.0 and max(max(w) for w in worths) == 1.0
    assert not llm.engine.closed
    known = min(min(w) for w in worths)
    may_stop = SamplingParams(temperature=0, max_tokens=12)
    for early_ends in (0, 10**6):
        seen.clear()
        llm.engine.early_ends = early_ends
        outs = llm.generate(helpers.prompts(16), may_stop, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [
            p[: len(o.outputs[0].token_ids)] for p, o in zip(plain_outputs, outs)
        ]
        weighed = [w for w in seen if w is not None]
        if early_ends == 0:
            assert weighed and known < min(min(w) for w in weighed) < 1.0
        else:
            assert seen and not weighed
