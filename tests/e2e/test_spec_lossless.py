"""Speculation changes nothing: greedy token-for-token equality, and sampled tokens follow the target's law."""

from __future__ import annotations

import pytest

from tests import helpers
from verispec import LLM, SamplingParams
from verispec.metrics import Counter, Vector

BATCHES = (1, 4, 16)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Plain greedy outputs for every batch size's prompts."""
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return {
        b: [o.outputs[0].token_ids for o in llm.generate(helpers.prompts(b, seed=b), sp, use_tqdm=False)]
        for b in BATCHES
    }


def _spec_configs(tiny_llama: str, tiny_draft: str, k: int) -> dict[str, dict]:
    return {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
        "draft_model_self": {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": k},
        "draft_model_poor": {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": k},
    }


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model_self", "draft_model_poor"])
def test_greedy_equality(tiny_llama, tiny_draft, reference, method, k):
    cfg = _spec_configs(tiny_llama, tiny_draft, k)[method]
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for b in BATCHES:
        outs = llm.generate(helpers.prompts(b, seed=b), sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference[b], f"{method} k={k} batch={b}"
    spec = llm.engine.counters.spec
    assert spec.num_draft_tokens > 0
    if method == "draft_model_self":
        # a model drafting for itself is always right
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    if method == "draft_model_poor":
        assert spec.num_accepted_tokens < spec.num_draft_tokens


def test_stop_inside_accepted_draft(tiny_llama, reference):
    """Stop token ids and max_tokens inside an accepted draft end the request where plain decoding would."""
    plain = reference[4]
    cfg = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 5}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    prompts = helpers.prompts(4, seed=4)
    for i, p in enumerate(prompts):
        stop_id = plain[i][7]
        out = llm.generate(
            p, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id], ignore_eos=True)
        )
        assert out[0].outputs[0].token_ids == plain[i][: plain[i].index(stop_id) + 1]
        out = llm.generate(p, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
        assert out[0].outputs[0].token_ids == plain[i][:9]


def test_mixed_greedy_and_sampled_batch(tiny_llama, tiny_draft, reference):
    cfg = {
        "method": "draft_model",
        "model": tiny_draft,
        "num_speculative_tokens": 3,
        "rejection_sample_method": "probabilistic",
    }
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    prompts = helpers.prompts(16, seed=16)
    sps = [
        SamplingParams(temperature=0 if i % 2 == 0 else 0.8, max_tokens=24, ignore_eos=True, seed=i)
        for i in range(16)
    ]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    for i in range(0, 16, 2):
        assert outs[i].outputs[0].token_ids == reference[16][i]
    again = llm.generate(prompts, sps, use_tqdm=False)
    # seeded: reproducible
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["ngram", "draft_model_poor"])
def test_greedy_equality_with_chunked_prefill(tiny_llama, tiny_draft, reference, method):
    """Prompts split over several prefill steps (target and draft alike): still the plain greedy tokens."""
    cfg = _spec_configs(tiny_llama, tiny_draft, 3)[method]
    llm = LLM(
        tiny_llama, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=8, speculative_config=cfg
    )
    outs = llm.generate(
        helpers.prompts(4, seed=4), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in outs] == reference[4]


@pytest.mark.parametrize("method", ["ngram", "draft_model_poor"])
def test_greedy_equality_with_logit_bias_allowed_tokens_and_bad_words(tiny_llama, tiny_draft, method):
    """The biased / restricted target is what drafts are verified against: the same tokens as plain decoding."""
    sp = SamplingParams(
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        allowed_token_ids=list(range(3, 200)),
        logit_bias={5: 3.0, 17: -2.0, 40: 1.5},
        # "a" is one token (67): banned at every verify position
        bad_words=["a", "the", "hello"],
    )
    prompts = helpers.prompts(4, seed=11)
    plain = LLM(tiny_llama, max_model_len=256, max_num_seqs=16).generate(prompts, sp, use_tqdm=False)
    cfg = _spec_configs(tiny_llama, tiny_draft, 3)[method]
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.counters.spec.num_draft_tokens > 0


def test_disable_by_batch_size(tiny_llama, reference):
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 2}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    outs = llm.generate(
        helpers.prompts(4, seed=4), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in outs] == reference[4]
    # only the first two requests speculate
    assert sum(o.num_draft_tokens > 0 for o in outs) == 2


def test_metrics_and_per_request_counts(tiny_llama):
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    outs = llm.generate(
        helpers.prompts(6, seed=9), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    m = {x.name: x for x in llm.get_metrics()}
    assert m["vllm:spec_decode_num_draft_tokens"].value == sum(o.num_draft_tokens for o in outs)
    assert m["vllm:spec_decode_num_accepted_tokens"].value == sum(o.num_accepted_tokens for o in outs)
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_pos) == 3
    assert sum(per_pos) == m["vllm:spec_decode_num_accepted_tokens"].value
    assert per_pos[0] >= per_pos[1] >= per_pos[2]
    assert m["vllm:generation_tokens"].value == 6 * 24


def test_vllm_spec_decode_example_reads_the_metrics(tiny_llama):
    # the metric-reading loop of vLLM's examples/offline_inference/spec_decode.py, run on verispec's get_metrics()
    k = 3
    cfg = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    outs = llm.generate(
        helpers.prompts(6, seed=9), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    num_drafts = num_draft_tokens = num_accepted_tokens = 0
    acceptance_counts = [0] * k
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            assert isinstance(metric, Counter)
            num_drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            assert isinstance(metric, Counter)
            num_draft_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            assert isinstance(metric, Counter)
            num_accepted_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            assert isinstance(metric, Vector)
            for pos in range(len(metric.values)):
                acceptance_counts[pos] += metric.values[pos]
    s = llm.engine.counters.spec
    assert (num_drafts, num_draft_tokens, num_accepted_tokens) == (
        s.num_drafts,
        s.num_draft_tokens,
        s.num_accepted_tokens,
    )
    assert num_draft_tokens == sum(o.num_draft_tokens for o in outs) > 0
    assert (
        acceptance_counts == s.num_accepted_tokens_per_pos and sum(acceptance_counts) == num_accepted_tokens
    )
    mean_acceptance_length = 1 + num_accepted_tokens / num_drafts
    assert 1.0 <= mean_acceptance_length <= 1 + k
    assert all(0.0 <= acceptance_counts[i] / num_drafts <= 1.0 for i in range(k))


# ------------------------------------------------------------------ distribution


@pytest.mark.parametrize(
    "method, top_p, block, parallel",
    [
        ("probabilistic", 1.0, False, False),
        ("strict", 1.0, False, False),
        ("probabilistic", 0.9, False, False),
        ("probabilistic", 1.0, True, False),
        ("probabilistic", 1.0, False, True),
    ],
)
def test_sampled_tokens_follow_target_distribution(
    tiny_llama, tiny_draft, tiny_pard_draft, method, top_p, block, parallel
):
    """Second output token (the first one produced by verification, against a deliberately poor draft) has
    exactly the target's marginal distribution: chi-square p-value must not be tiny; a wrong law must fail.
    Block Verify (3 drafts: it applies from 3) and parallel drafting (drafts from mask positions) keep the law too."""
    cfg = {
        "method": "draft_model",
        "model": tiny_pard_draft if parallel else tiny_draft,
        "parallel_drafting": parallel,
        "num_speculative_tokens": 3 if block else 2,
        "rejection_sample_method": method,
        "enable_block_verify": block,
    }
    llm = LLM(
        tiny_llama,
        max_model_len=64,
        max_num_seqs=64,
        speculative_config=cfg,
        seed=1234,
        spec_token_budget=1024,
    )
    helpers.assert_second_token_law(llm, top_p)
    spec = llm.engine.counters.spec
    # the draft is poor but not useless
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def _sampled_params(n: int) -> list[SamplingParams]:
    """Seeded sampled requests with the sampler's options mixed: temperature, top-k, top-p, min-p (the dense
    path), penalties, and a greedy one."""
    options = [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.3, "top_k": 20},
        {"temperature": 0.0},
        {"temperature": 0.9, "min_p": 0.05},
        {"temperature": 1.0, "repetition_penalty": 1.2},
    ]
    return [
        SamplingParams(max_tokens=24, ignore_eos=True, seed=100 + i, **options[i % len(options)])
        for i in range(n)
    ]


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model_poor", "tree"])
def test_strict_sampled_output_equals_plain_sampled_output(
    tiny_llama, tiny_draft, pass_through_eagle, method, adaptive
):
    """Under `strict` verification (the default) a position's sample reads the same uniform whichever step scores
    it, so a seeded sampled request emits exactly the tokens plain decoding samples, whatever the drafts."""
    configs = {
        **_spec_configs(tiny_llama, tiny_draft, 3),
        "suffix": {"method": "suffix", "num_speculative_tokens": 4},
        "tree": {
            "method": "eagle",
            "model": pass_through_eagle,
            "num_speculative_tokens": 2,
            "speculative_token_tree": TREE,
        },
    }
    cfg = {**configs[method], "enable_adaptive_verification": adaptive}
    prompts, params = helpers.prompts(12, seed=3), _sampled_params(12)
    plain = LLM(tiny_llama, max_model_len=256, max_num_seqs=16)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg, spec_token_budget=4096)
    # alone and in a batch
    got = [
        llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts[:2], params[:2])
    ]
    got += [o.outputs[0].token_ids for o in llm.generate(prompts[2:], params[2:], use_tqdm=False)]
    assert got == want
    spec = llm.engine.counters.spec
    assert spec.num_accepted_tokens > 0


def test_probabilistic_sampled_output_differs_from_plain(tiny_llama, tiny_draft):
    """The identity above is strict's: `probabilistic` draws its own acceptance uniforms, so the same seeded requests
    give other text (the same law), which also shows the identity test can fail."""
    cfg = {
        **_spec_configs(tiny_llama, tiny_draft, 3)["draft_model_poor"],
        "rejection_sample_method": "probabilistic",
    }
    prompts, params = helpers.prompts(12, seed=3), _sampled_params(12)
    plain = LLM(tiny_llama, max_model_len=256, max_num_seqs=16)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # the greedy request (index 3) is the same either way
    assert got[3] == want[3] and got != want


def test_synthetic_acceptance_rate_is_the_mean_over_positions(tiny_llama, tiny_draft):
    """rejection_sample_method 'synthetic' with rate r: accepted / drafted averages r over the K positions (as vLLM;
    the old per-position r gave (r + r^2 + r^3) / 3 = 0.39 for K = 3, r = 0.6), greedy requests keep the greedy
    rule."""
    k, r = 3, 0.6
    cfg = {
        "method": "draft_model",
        "model": tiny_draft,
        "num_speculative_tokens": k,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rate": r,
        # k drafts every step (the planner would verify fewer)
        "enable_adaptive_verification": False,
    }
    llm = LLM(
        tiny_llama, max_model_len=256, max_num_seqs=32, speculative_config=cfg, seed=7, spec_token_budget=1024
    )
    sp = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True)
    llm.generate(helpers.prompts(32, seed=11), sp, use_tqdm=False)
    s = llm.engine.counters.spec
    # k drafts per step, fewer near max_tokens: each row is calibrated for its own draft count
    assert (
        s.num_draft_tokens_per_pos[0] == s.num_drafts > 400 and s.num_draft_tokens_per_pos[-1] < s.num_drafts
    )
    # accepted / drafted per draft lies in [0, 1]: its std is at most 0.5
    assert abs(s.acceptance_rate - r) < 5 * 0.5 / s.num_drafts**0.5, (s.acceptance_rate, s.num_drafts)
    rates = s.per_position_rates()
    # position-decaying
    assert rates[0] > rates[1] > rates[2]


@pytest.mark.parametrize(
    "spelling, k",
    [
        ({"rejection_sample_method": "standard", "draft_sample_method": "greedy"}, 2),
        ({"rejection_sample_method": "block"}, 3),
    ],
)
def test_vllm_spellings_keep_the_target_distribution(tiny_llama, tiny_draft, spelling, k):
    """Current vLLM's 'standard' (Leviathan / Chen) with argmax drafts (q one-hot) and 'block' (Block Verification)
    run this build's probabilistic verification and keep the target's law."""
    cfg = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": k, **spelling}
    llm = LLM(
        tiny_llama, max_model_len=64, max_num_seqs=64, speculative_config=cfg, seed=5, spec_token_budget=1024
    )
    spec = llm.speculative_config
    assert spec.rejection_sample_method == "probabilistic"
    assert spec.enable_block_verify == (spelling["rejection_sample_method"] == "block")
    assert llm.engine.opts.verify.block == spec.enable_block_verify
    greedy_drafts = spelling.get("draft_sample_method") == "greedy"
    assert llm.engine.proposer.sample_drafts is not greedy_drafts
    assert llm.engine.proposer.keep_probs is not greedy_drafts
    helpers.assert_second_token_law(llm)
    s = llm.engine.counters.spec
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens


def test_greedy_draft_sampling_drafts_the_argmax(tiny_llama, tiny_draft):
    """draft_sample_method 'greedy': a sampled request's drafts are the draft model's argmax continuation."""
    cfg = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3}
    prompt = helpers.prompts(1, seed=2)
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=9)
    drafts = {}
    for mode in ("greedy", "probabilistic"):
        llm = LLM(tiny_llama, max_model_len=256, speculative_config={**cfg, "draft_sample_method": mode})
        seen = []
        propose = llm.engine.proposer.propose

        def spy(reqs, k_max, propose=propose, seen=seen):
            prop = propose(reqs, k_max)
            seen.extend(
                (list(r.prompt_token_ids) + list(r.output_token_ids), d) for r, d in zip(reqs, prop.token_ids)
            )
            return prop

        llm.engine.proposer.propose = spy
        llm.generate(prompt, sp, use_tqdm=False)
        drafts[mode] = seen
    plain_draft = LLM(tiny_draft, max_model_len=256)

    def argmax_continuation(context: list[int], n: int) -> list[int]:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return plain_draft.generate({"prompt_token_ids": context}, sp, use_tqdm=False)[0].outputs[0].token_ids

    assert any(d for _, d in drafts["greedy"])
    assert all(argmax_continuation(c, len(d)) == d for c, d in drafts["greedy"] if d)
    # the default for draft_model samples drafts: they leave the argmax somewhere (the check above has power)
    assert any(argmax_continuation(c, len(d)) != d for c, d in drafts["probabilistic"] if d)


@pytest.mark.parametrize("method", ["ngram", "draft_model_poor"])
def test_block_and_entropy_verify_leave_greedy_output_unchanged(tiny_llama, tiny_draft, reference, method):
    """Both change only the p/q test of sampled requests; greedy requests keep the greedy rule (vLLM Ascend's
    behaviour). A sampled request in the same batch runs through them (Entropy Verify is not lossless by design, so
    no law is asserted for it)."""
    cfg = {
        **_spec_configs(tiny_llama, tiny_draft, 4)[method],
        "rejection_sample_method": "probabilistic",
        "enable_block_verify": True,
        "enable_entropy_verify": True,
        "posterior_alpha": 1.0,
    }
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    outs = llm.generate(helpers.prompts(4, seed=4), [greedy, sampled, greedy, greedy], use_tqdm=False)
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 3)] == [reference[4][i] for i in (0, 2, 3)]
    assert len(outs[1].outputs[0].token_ids) == 24 and outs[1].num_draft_tokens > 0


@pytest.mark.parametrize("batch", [1, 8])
def test_suffix_greedy_equality_and_learning(tiny_llama, batch):
    plain = LLM(tiny_llama, max_model_len=256, max_num_seqs=16)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = helpers.prompts(batch, seed=30 + batch)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    cfg = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 100}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    first = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == ref
    # outputs now sit in the global tree
    second = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == ref
    acc1 = sum(o.num_accepted_tokens for o in first) / max(1, sum(o.num_draft_tokens for o in first))
    acc2 = sum(o.num_accepted_tokens for o in second) / max(1, sum(o.num_draft_tokens for o in second))
    assert acc2 > acc1 and acc2 > 0.8


def test_logprobs_with_speculation_equal_plain(tiny_llama):
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    prompts = helpers.prompts(3, seed=40)
    plain = LLM(tiny_llama, max_model_len=256).generate(prompts, sp, use_tqdm=False)
    cfg = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    spec = LLM(tiny_llama, max_model_len=256, speculative_config=cfg).generate(prompts, sp, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert ea.keys() == eb.keys()
            assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 and ea[t].rank == eb[t].rank for t in ea)


def test_draft_max_model_len_stops_drafting(tiny_llama, reference):
    """speculative_config.max_model_len: requests longer than it decode without drafts (still lossless)."""
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "max_model_len": 20}
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    outs = llm.generate(
        helpers.prompts(4, seed=4), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in outs] == reference[4]
    long_prompts = [o for o in outs if len(o.prompt_token_ids) >= 19]
    assert long_prompts and all(o.num_draft_tokens == 0 for o in long_prompts)


def test_medusa_method_is_inferred_and_drafts_get_accepted(tiny_llama, tmp_path):
    """Heads that copy the target's LM head draft the target's next token again: accepted whenever the target
    repeats itself; the method comes from the checkpoint's model_type, as in vLLM."""
    from pathlib import Path

    from tests.tiny_models import write_tiny_medusa

    folder = write_tiny_medusa(tmp_path / "m", Path(tiny_llama), num_heads=3, copy_head=True)
    llm = LLM(
        tiny_llama, max_model_len=256, speculative_config={"model": str(folder), "num_speculative_tokens": 3}
    )
    plain = LLM(tiny_llama, max_model_len=256)
    prompt = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7]}]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.generate(prompt, sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    repeats = sum(a == b for a, b in zip(out.outputs[0].token_ids, out.outputs[0].token_ids[1:]))
    # this seed: 16 repeats, 13 drafts accepted
    assert repeats > 0 and out.num_accepted_tokens > 0


def test_medusa_sampled_with_probabilistic_runs(tiny_llama, tiny_medusa):
    cfg = {
        "method": "medusa",
        "model": tiny_medusa,
        "num_speculative_tokens": 4,
        "rejection_sample_method": "probabilistic",
        "enable_block_verify": True,
    }
    llm = LLM(tiny_llama, max_model_len=256, speculative_config=cfg)
    sp = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=1)
    a = llm.generate(helpers.prompts(2), sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in a)


def test_medusa_config_errors(tiny_llama, tiny_medusa):
    cases = [
        ({"model": tiny_medusa, "num_speculative_tokens": 6}, "has 5 heads"),
        ({"model": "/nonexistent/medusa", "num_speculative_tokens": 2}, "nonexistent"),
        ({"model": tiny_llama, "num_speculative_tokens": 2}, "not a Medusa checkpoint"),
    ]
    for extra, match in cases:
        with pytest.raises(ValueError, match=match):
            LLM(tiny_llama, speculative_config={"method": "medusa", **extra})


def test_mlp_speculator_config_errors(tiny_llama, tiny_mlp_speculator):
    with pytest.raises(ValueError, match="num_speculative_tokens:5 must be divisible by n_predict=4"):
        LLM(tiny_llama, speculative_config={"model": tiny_mlp_speculator, "num_speculative_tokens": 5})
    with pytest.raises(ValueError, match="has 4 stages"):
        LLM(tiny_llama, speculative_config={"model": tiny_mlp_speculator, "num_speculative_tokens": 8})


def test_eagle_config_errors(tiny_llama, tmp_path):
    import json
    from pathlib import Path

    from tests.tiny_models import write_tiny_eagle

    folder = write_tiny_eagle(tmp_path / "e", Path(tiny_llama))
    cfg = json.loads((folder / "config.json").read_text())
    spec = {"method": "eagle", "model": str(folder), "num_speculative_tokens": 2}
    (folder / "config.json").write_text(json.dumps({**cfg, "vocab_size": 999}))
    with pytest.raises(ValueError, match="EAGLE vocab_size=999 but the target's is"):
        LLM(tiny_llama, speculative_config=spec)
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with pytest.raises(ValueError, match="EAGLE weight 'fc.weight' has shape"):
        LLM(tiny_llama, speculative_config=spec)


def test_eagle3_config_errors(tiny_llama, tmp_path):
    from pathlib import Path

    from tests.tiny_models import write_tiny_eagle3

    folder = write_tiny_eagle3(tmp_path / "e", Path(tiny_llama), layer_ids=[0, 1, 9])
    with pytest.raises(
        ValueError, match=r"eagle_aux_hidden_state_layer_ids \[0, 1, 9\] must be 3 layer ids in 0..3"
    ):
        LLM(
            tiny_llama,
            speculative_config={"method": "eagle3", "model": str(folder), "num_speculative_tokens": 2},
        )


# None: num_speculative_tokens from num_nextn_predict_layers (1)
@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("batch", [1, 4])
# "dynamic": EAGLE-2 trees from the MTP layer
@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_mtp_greedy_equality(tiny_mimo, k, batch, tree):
    plain = LLM(tiny_mimo, max_model_len=256, max_num_seqs=16)
    cfg = {"method": "mtp", **({"num_speculative_tokens": k} if k else {})}
    if tree is not None:
        cfg |= {"speculative_token_tree": tree, "num_draft_tokens": 6}
    llm = LLM(tiny_mimo, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    assert llm.engine.opts.num_speculative_tokens == (k or 1)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = helpers.prompts(batch, seed=batch)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected
    assert llm.engine.counters.spec.num_draft_tokens > 0


def test_mtp_needs_a_target_with_mtp_layers(tiny_llama):
    with pytest.raises(
        ValueError, match="method 'mtp' needs a checkpoint with MTP layers, but the draft model_type"
    ):
        LLM(tiny_llama, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch", BATCHES)
def test_parallel_drafting_greedy_equality(tiny_llama, tiny_pard_draft, reference, k, batch):
    cfg = {
        "method": "draft_model",
        "model": tiny_pard_draft,
        "num_speculative_tokens": k,
        "parallel_drafting": True,
    }
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    assert llm.engine.proposer.mask_token == 3
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(helpers.prompts(batch, seed=batch), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference[batch]
    assert llm.engine.counters.spec.num_draft_tokens > 0


def test_parallel_self_draft_first_draft_is_always_right(tiny_llama, tmp_path):
    """The target as its own parallel draft: the newest token's position is an ordinary forward, so draft 1 is the
    target's own greedy token and is accepted at every step (the mask positions' drafts are guesses)."""
    import json
    import shutil

    folder = tmp_path / "self"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "pard_token": 7}))
    spec = {
        "method": "draft_model",
        "model": str(folder),
        "num_speculative_tokens": 3,
        "parallel_drafting": True,
    }
    llm = LLM(tiny_llama, max_model_len=256, speculative_config=spec)
    out = llm.generate(
        helpers.prompts(1), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0]
    stats = llm.engine.counters.spec
    assert out.num_accepted_tokens >= stats.num_drafts > 0


def test_parallel_drafting_errors(tiny_llama, tiny_draft):
    with pytest.raises(
        ValueError,
        match="For parallel drafting, the draft model config must have `dflash_config.mask_token_id`",
    ):
        LLM(
            tiny_llama,
            speculative_config={
                "method": "draft_model",
                "model": tiny_draft,
                "num_speculative_tokens": 2,
                "parallel_drafting": True,
            },
        )


TREE = "[(0,), (1,), (2,), (3,), (4,), (5,), (0, 0), (1, 0), (2, 0)]"


@pytest.fixture(scope="module")
def pass_through_eagle(tiny_llama, tmp_path_factory) -> str:
    from pathlib import Path

    from tests.tiny_models import write_tiny_eagle

    return str(
        write_tiny_eagle(tmp_path_factory.mktemp("pt_eagle") / "e", Path(tiny_llama), copy_hidden=True)
    )


# 8 x 10 rows exceed the step budget (32): the top-1 chain is verified
@pytest.mark.parametrize(
    "batch",
    [1, 3, 8],
)
def test_token_tree_greedy_equality_and_branch_acceptance(tiny_llama, pass_through_eagle, monkeypatch, batch):
    """A tree (6 root children, 3 of them with a child) drafted by EAGLE and verified in one forward: the output is
    plain decoding's, and accepted paths through a non-first branch had their K/V moved into place."""
    from verispec.runner.kv_cache import KVCache

    moves = []
    move = KVCache.move
    monkeypatch.setattr(KVCache, "move", lambda self, slot, s, d: (moves.append(s), move(self, slot, s, d)))
    spec = {
        "method": "eagle",
        "model": pass_through_eagle,
        "num_speculative_tokens": 2,
        "speculative_token_tree": TREE,
    }
    # the CPU's default step budget, on any device
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=spec, spec_token_budget=32)
    plain = LLM(tiny_llama, max_model_len=256, max_num_seqs=16)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = helpers.prompts(batch, seed=batch + 40)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected
    stats = llm.engine.counters.spec
    # whole trees (the last steps, with room for fewer than 2 drafts, verify chains)
    if batch * 10 <= 32:
        # and some non-first branches won
        assert stats.num_draft_tokens > 5 * stats.num_drafts and moves
    # mostly chains: 8 trees of 10 rows exceed the step budget (steps with fewer running requests need not)
    else:
        assert stats.num_draft_tokens < 3 * stats.num_drafts


@pytest.mark.parametrize("tree", [None, TREE])
def test_request_output_spec_decode_metrics_add_up_to_the_engine_counters(
    tiny_llama, pass_through_eagle, tree
):
    """RequestOutput.spec_decode_metrics (per request, per position; per_request_spec_decode_metrics detailed) of a
    chain or a tree sum to the engine's spec-decode counters; a plain engine reports none."""
    spec = {"method": "eagle", "model": pass_through_eagle, "num_speculative_tokens": 2}
    llm = LLM(
        tiny_llama,
        max_model_len=256,
        max_num_seqs=16,
        speculative_config=spec | {"speculative_token_tree": tree},
        per_request_spec_decode_metrics="detailed",
    )
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(helpers.prompts(3, seed=7) + [{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)
    ms = [o.spec_decode_metrics for o in outs]
    for o, m in zip(outs, ms):
        assert (m.num_draft_tokens, m.num_accepted_tokens) == (o.num_draft_tokens, o.num_accepted_tokens)
        assert sum(m.acceptance_histogram) == m.num_spec_steps == len(m.per_step_accepted)
        assert sum(m.per_step_drafted) == m.num_draft_tokens
        assert all(a <= d for a, d in zip(m.num_accepted_tokens_per_pos, m.num_draft_tokens_per_pos))
    stats = llm.engine.counters.spec
    assert sum(m.num_spec_steps for m in ms) == stats.num_drafts > 0
    for name in ("num_draft_tokens_per_pos", "num_accepted_tokens_per_pos"):
        assert [sum(col) for col in zip(*(getattr(m, name) for m in ms))] == getattr(stats, name)
    plain = LLM(tiny_llama, max_model_len=256)
    assert (
        plain.generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)[0].spec_decode_metrics is None
    )


def test_token_tree_sampled_tokens_follow_target_distribution(tiny_llama, pass_through_eagle):
    """strict verification of a tree: every emitted token is the target's own sample at its node (4 tokens: the
    second comes from a whole-tree step, which needs room for the tree's 2 levels)."""
    spec = {
        "method": "eagle",
        "model": pass_through_eagle,
        "num_speculative_tokens": 2,
        "speculative_token_tree": TREE,
    }
    llm = LLM(
        tiny_llama, max_model_len=64, max_num_seqs=64, speculative_config=spec, seed=7, spec_token_budget=4096
    )
    helpers.assert_second_token_law(llm, max_tokens=4)
    assert llm.engine.counters.spec.num_accepted_tokens > 0


def test_token_tree_config_errors(tiny_llama, tiny_eagle):
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": TREE}
    with pytest.raises(
        ValueError, match="tree drafting is supported with methods eagle, eagle3, mtp, not 'ngram'"
    ):
        LLM(tiny_llama, speculative_config=ngram)
    eagle = {
        "method": "eagle",
        "model": tiny_eagle,
        "num_speculative_tokens": 2,
        "speculative_token_tree": TREE,
    }
    synthetic = eagle | {"rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.5}
    with pytest.raises(ValueError, match="trees are verified with rejection_sample_method 'strict'"):
        LLM(tiny_llama, speculative_config=synthetic)
    block = eagle | {"rejection_sample_method": "probabilistic", "enable_block_verify": True}
    with pytest.raises(ValueError, match="enable_block_verify applies to chains only"):
        LLM(tiny_llama, speculative_config=block)
    dynamic = eagle | {"speculative_token_tree": "dynamic"}
    with pytest.raises(
        ValueError, match="tree drafting is supported with methods eagle, eagle3, mtp, not 'ngram'"
    ):
        LLM(tiny_llama, speculative_config=ngram | {"speculative_token_tree": "dynamic"})
    with pytest.raises(
        ValueError, match="eagle_topk sizes dynamic trees: it needs speculative_token_tree 'dynamic'"
    ):
        LLM(tiny_llama, speculative_config=eagle | {"eagle_topk": 2})
    with pytest.raises(ValueError, match="eagle_topk=0 must be >= 1"):
        LLM(tiny_llama, speculative_config=dynamic | {"eagle_topk": 0})
    with pytest.raises(ValueError, match=r"num_draft_tokens=1 must be in \[2, "):
        LLM(tiny_llama, speculative_config=dynamic | {"num_draft_tokens": 1})
    with pytest.raises(ValueError, match="'eagle_topk' must be an int or null"):
        LLM(tiny_llama, speculative_config=dynamic | {"eagle_topk": "4"})


def _mean_accepted(llm: LLM) -> float:
    spec = llm.engine.counters.spec
    return spec.num_accepted_tokens / max(1, spec.num_drafts)


def test_token_tree_probabilistic_follows_target_distribution(tiny_llama, pass_through_eagle):
    """`probabilistic` on a static tree: random requests' children are sampled from the drafter without replacement
    and verified by recursive rejection sampling; the second token (a root child or the residual's sample, from a
    whole-tree step: 4 tokens leave room for the tree's 2 levels) follows the target's law."""
    spec = {
        "method": "eagle",
        "model": pass_through_eagle,
        "num_speculative_tokens": 2,
        "speculative_token_tree": TREE,
        "rejection_sample_method": "probabilistic",
        # every step verifies a whole tree
        "enable_adaptive_verification": False,
    }
    llm = LLM(
        tiny_llama, max_model_len=64, max_num_seqs=64, speculative_config=spec, seed=7, spec_token_budget=4096
    )
    helpers.assert_second_token_law(llm, max_tokens=4)
    assert llm.engine.counters.spec.num_accepted_tokens > 0
    # 3 tokens: the step after the prompt has room for one level only; its chain of first draws carries q
    helpers.assert_second_token_law(llm, max_tokens=3)


def test_token_tree_probabilistic_accepts_more_than_the_strict_walk(tiny_llama, pass_through_eagle):
    """Sampled children judged against the drafter's probabilities accept far more than the target's own sample
    landing on a top-ranked child (the tiny target's distributions are flat: strict accepts ~6/320 per level)."""
    base = {
        "method": "eagle",
        "model": pass_through_eagle,
        "num_speculative_tokens": 2,
        "speculative_token_tree": TREE,
        "enable_adaptive_verification": False,
    }
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    accepted = {}
    for method in ("strict", "probabilistic"):
        spec = base | {"rejection_sample_method": method}
        llm = LLM(
            tiny_llama,
            max_model_len=64,
            max_num_seqs=32,
            speculative_config=spec,
            seed=5,
            spec_token_budget=4096,
        )
        llm.generate(helpers.prompts(32, seed=9), sp, use_tqdm=False)
        accepted[method] = _mean_accepted(llm)
    assert accepted["probabilistic"] > 0.5 > 0.2 > accepted["strict"]


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_dynamic_tree_follows_target_distribution(tiny_llama, tiny_eagle, method):
    """Dynamic trees under sampling: verified with the target's own picks (their nodes are chosen by their own draft
    confidence), whatever the rule; the second token follows the target's law."""
    spec = {
        "method": "eagle",
        "model": tiny_eagle,
        "num_speculative_tokens": 2,
        "speculative_token_tree": "dynamic",
        "eagle_topk": 3,
        "num_draft_tokens": 7,
        "rejection_sample_method": method,
        "enable_adaptive_verification": False,
    }
    llm = LLM(
        tiny_llama, max_model_len=64, max_num_seqs=64, speculative_config=spec, seed=3, spec_token_budget=4096
    )
    helpers.assert_second_token_law(llm, max_tokens=4)
    assert llm.engine.counters.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("drafter", ["pass_through_eagle", "tiny_eagle", "tiny_eagle3"])
def test_dynamic_tree_greedy_equality(request, tiny_llama, monkeypatch, drafter, batch):
    """EAGLE-2 dynamic trees (one per request and step, per-request attention masks) verified in one forward: the
    output is plain decoding's; whole trees ran (batch 8 x 8 rows exceeds the step budget: chains there)."""
    from verispec.proposers.eagle import EagleProposer
    from verispec.runner.kv_cache import KVCache

    moves, shapes = [], []
    move = KVCache.move
    monkeypatch.setattr(KVCache, "move", lambda self, slot, s, d: (moves.append(s), move(self, slot, s, d)))
    propose = EagleProposer._propose_dynamic

    def spy(self, *args):
        prop = propose(self, *args)
        # whether the requests of this step got differently shaped trees
        shapes.append(bool((prop.tree.parent != prop.tree.parent[:1]).any()))
        return prop

    monkeypatch.setattr(EagleProposer, "_propose_dynamic", spy)
    spec = {
        "method": "eagle3" if drafter == "tiny_eagle3" else "eagle",
        "model": request.getfixturevalue(drafter),
        "num_speculative_tokens": 3,
        "speculative_token_tree": "dynamic",
        "eagle_topk": 3,
        "num_draft_tokens": 8,
    }
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=spec)
    plain = LLM(tiny_llama, max_model_len=256, max_num_seqs=16)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = helpers.prompts(batch, seed=batch + 60)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected
    stats = llm.engine.counters.spec
    if batch * 8 <= 32:
        # 7 nodes per whole-tree step
        assert stats.num_draft_tokens > 4 * stats.num_drafts
    if drafter == "pass_through_eagle" and batch * 8 <= 32:
        assert stats.num_accepted_tokens > 0 and moves
    if drafter == "tiny_eagle" and batch > 1:
        assert any(shapes)


DRAFTERS = {
    "medusa": "tiny_medusa",
    "mlp_speculator": "tiny_mlp_speculator",
    "eagle": "tiny_eagle",
    "eagle3": "tiny_eagle3",
    "dflash": "tiny_dflash",
}


@pytest.mark.parametrize("batch", BATCHES)
# k None: mlp_speculator's n_predict (4), the method inferred from its model_type
@pytest.mark.parametrize(
    "method, k", [(m, k) for m in DRAFTERS for k in (1, 3, 4)] + [("mlp_speculator", None)]
)
def test_model_drafter_greedy_equality(request, tiny_llama, reference, method, k, batch):
    cfg = {"model": request.getfixturevalue(DRAFTERS[method])}
    # else method and num_speculative_tokens come from the checkpoint, as in vLLM
    if k is not None:
        cfg.update(method=method, num_speculative_tokens=k)
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, speculative_config=cfg)
    assert llm.engine.opts.num_speculative_tokens == (k or 4)
    if method == "eagle3":
        # vLLM's default (2, L // 2, L - 3) for 3 layers
        assert llm.engine.proposer.needs.aux_layers == (
            2,
            1,
            0,
        )
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(helpers.prompts(batch, seed=batch), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference[batch]
    assert llm.engine.counters.spec.num_draft_tokens > 0


def _pass_through(kind: str, target: str, folder) -> tuple[str, dict]:
    """(target model, speculative_config) whose drafter hands the target's own state to the target's head: its
    first draft must then be the newest token at every step (any misaligned state gives something else)."""
    from pathlib import Path

    from tests.tiny_models import write_tiny_eagle, write_tiny_eagle3, write_tiny_mimo

    if kind == "eagle":
        return target, {
            "method": "eagle",
            "model": str(write_tiny_eagle(folder, Path(target), copy_hidden=True)),
        }
    # the third stream is the last layer's output (aux id num_layers)
    if kind == "eagle3":
        draft = write_tiny_eagle3(folder, Path(target), copy_final=True, layer_ids=[0, 1, 3])
        return target, {"method": "eagle3", "model": str(draft)}
    return str(write_tiny_mimo(folder, pass_through=True)), {"method": "mtp"}


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_state_drafters_read_the_state_behind_the_newest_token(tiny_llama, tmp_path, kind):
    """EAGLE, EAGLE-3 and MTP drafts come from target states the engine hands over after every forward (prompt chunks
    included): a pass-through drafter's first draft is always the newest token, its drafts are accepted whenever the
    target repeats itself, and the output is plain decoding's."""
    model, cfg = _pass_through(kind, tiny_llama, tmp_path / kind)
    llm = LLM(
        model,
        max_model_len=256,
        speculative_config={**cfg, "num_speculative_tokens": 3},
        max_num_batched_tokens=8,
    )
    seen, propose = [], llm.engine.proposer.propose

    def spy(reqs, k_max):
        prop = propose(reqs, k_max)
        seen.extend((r.output_token_ids[-1], d[:1]) for r, d in zip(reqs, prop.token_ids))
        return prop

    llm.engine.proposer.propose = spy
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7] * 3}, {"prompt_token_ids": [9, 10, 11]}]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    plain = LLM(model, max_model_len=256).generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    # [] where max_tokens leaves no room
    assert seen and all(d in ([], [newest]) for newest, d in seen)
    assert sum(o.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize(
    "method, rule",
    [
        ("eagle", "probabilistic"),
        ("eagle3", "strict"),
        ("medusa", "probabilistic"),
        ("mlp_speculator", "strict"),
        ("dflash", "probabilistic"),
    ],
)
def test_model_drafter_sampled_tokens_follow_target_distribution(request, tiny_llama, method, rule):
    """The model-based drafters' argmax drafts (q one-hot) keep the target's law under both rejection rules."""
    spec = {
        "method": method,
        "model": request.getfixturevalue(DRAFTERS[method]),
        "num_speculative_tokens": 2,
        "rejection_sample_method": rule,
    }
    llm = LLM(
        tiny_llama,
        max_model_len=64,
        max_num_seqs=64,
        speculative_config=spec,
        seed=11,
        spec_token_budget=1024,
    )
    helpers.assert_second_token_law(llm)
    assert llm.engine.counters.spec.num_draft_tokens > 0
