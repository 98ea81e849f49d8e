"""The paged KV cache with automatic prefix caching changes no output: cached prefixes, cache salts, preemption
under a small budget, prompt logprobs and seeded sampling, against the same engine with the cache off."""

from __future__ import annotations

import pytest

from tests import helpers
from verispec import LLM, SamplingParams
from verispec.metrics import Counter, Gauge

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _turns(llm: LLM, prompts: list[dict], sp: SamplingParams = GREEDY) -> list[list[int]]:
    """Two turns of a chat: the second prompt is the first prompt, its answer and a follow-up."""
    first = llm.generate(prompts, sp, use_tqdm=False)
    follow = [
        {"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids + [7, 8, 9, 10]}
        for p, o in zip(prompts, first)
    ]
    return _ids(first) + _ids(llm.generate(follow, sp, use_tqdm=False))


@pytest.fixture(scope="module")
def uncached(tiny_llama):
    return LLM(tiny_llama, max_model_len=256, enable_prefix_caching=False)


def test_a_second_turn_reuses_the_first_and_changes_nothing(tiny_llama, uncached):
    llm = LLM(tiny_llama, max_model_len=256)
    prompts = helpers.prompts(4, seed=3)
    assert _turns(llm, prompts) == _turns(uncached, prompts)
    c = llm.engine.counters
    # turn 2 finds turn 1's prompt and answer: every full block but the one holding the last token
    assert c.prefix_cache_hits > 0 and c.prefix_cache_hits % 16 == 0
    assert c.prefix_cache_queries == sum(len(p["prompt_token_ids"]) for p in prompts) * 2 + 4 * (20 + 4)
    assert uncached.engine.counters.prefix_cache_hits == 0


def test_a_fully_cached_prompt_still_computes_its_last_token(tiny_llama, uncached):
    llm = LLM(tiny_llama, max_model_len=256, block_size=8)
    prompt = [{"prompt_token_ids": list(range(3, 35))}]
    ref = _ids(uncached.generate(prompt, GREEDY, use_tqdm=False))
    assert _ids(llm.generate(prompt, GREEDY, use_tqdm=False)) == ref
    assert _ids(llm.generate(prompt, GREEDY, use_tqdm=False)) == ref
    # 32 tokens: 3 of its 4 blocks are reused, the last one is recomputed for its logits
    assert llm.engine.counters.prefix_cache_hits == 24


def test_cache_salts_never_share_blocks(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=256)
    ids = list(range(3, 60))
    llm.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)
    c = llm.engine.counters
    llm.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)
    llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert c.prefix_cache_hits == 0
    llm.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)
    assert c.prefix_cache_hits == 48
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([{"prompt_token_ids": ids, "cache_salt": 3}], GREEDY, use_tqdm=False)


def test_reset_prefix_cache_forgets_every_prefix(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=256)
    prompt = [{"prompt_token_ids": list(range(3, 60))}]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.reset_prefix_cache()
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.engine.counters.prefix_cache_hits == 0


def test_prompt_logprobs_are_computed_for_every_position(tiny_llama, uncached):
    llm = LLM(tiny_llama, max_model_len=256)
    prompt = [{"prompt_token_ids": list(range(3, 60))}]
    sp = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    llm.generate(prompt, GREEDY, use_tqdm=False)
    got = llm.generate(prompt, sp, use_tqdm=False)[0].prompt_logprobs
    assert got == uncached.generate(prompt, sp, use_tqdm=False)[0].prompt_logprobs


def test_seeded_samples_are_the_same_with_the_cache(tiny_llama, uncached):
    llm = LLM(tiny_llama, max_model_len=256)
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=11, ignore_eos=True)
    prompts = helpers.prompts(3, seed=5)
    assert _turns(llm, prompts, sp) == _turns(uncached, prompts, sp)


@pytest.mark.parametrize("spec", [None, helpers.NGRAM, {"method": "suffix", "num_speculative_tokens": 4}])
def test_preemption_under_a_small_budget_changes_nothing(tiny_llama, uncached, spec):
    """16 ragged requests in a pool of a few sequences' blocks: requests are preempted and recomputed, every
    output is plain decoding's."""
    per_tok = uncached.engine.runner.model.cfg.kv_bytes_per_token
    budget = per_tok * 16 * 40
    llm = LLM(
        tiny_llama, max_model_len=256, max_num_seqs=16, kv_cache_memory_bytes=budget, speculative_config=spec
    )
    prompts = helpers.prompts(16, seed=9)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(
        uncached.generate(prompts, sp, use_tqdm=False)
    )
    assert llm.engine.counters.num_preemptions > 0
    assert llm.engine.cache.usage == 0


def test_the_cache_reports_vllms_metrics(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=256)
    prompt = [{"prompt_token_ids": list(range(3, 60))}]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    llm.generate(prompt, GREEDY, use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert isinstance(metrics["vllm:prefix_cache_queries"], Counter)
    assert metrics["vllm:prefix_cache_queries"].value == 2 * 57
    assert metrics["vllm:prefix_cache_hits"].value == 48
    assert isinstance(metrics["vllm:kv_cache_usage_perc"], Gauge)
    assert "vllm:num_preemptions" in metrics


def test_a_drafter_of_every_state_drafts_the_same_from_a_cached_prefix(tiny_llama, tiny_eagle):
    """EAGLE's drafts on turn 2 read the target's states of the cached positions from the pool beside the KV
    blocks: with a fixed K they are the very drafts (the same accepted count) an engine without the cache makes
    after computing those states itself."""
    spec = {
        "method": "eagle",
        "model": tiny_eagle,
        "num_speculative_tokens": 3,
        "enable_adaptive_verification": False,
    }
    prompts = helpers.prompts(3, seed=5)
    cached = LLM(tiny_llama, max_model_len=256, speculative_config=spec)
    first = cached.generate(prompts, GREEDY, use_tqdm=False)
    follow = [
        {"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids + [7, 8, 9, 10]}
        for p, o in zip(prompts, first)
    ]
    c = cached.engine.counters
    before = (c.spec.num_draft_tokens, c.spec.num_accepted_tokens, c.prefix_cache_hits)
    want = _ids(cached.generate(follow, GREEDY, use_tqdm=False))
    drafted, accepted = c.spec.num_draft_tokens - before[0], c.spec.num_accepted_tokens - before[1]
    assert c.prefix_cache_hits > before[2]
    fresh = LLM(tiny_llama, max_model_len=256, speculative_config=spec, enable_prefix_caching=False)
    assert _ids(fresh.generate(follow, GREEDY, use_tqdm=False)) == want
    f = fresh.engine.counters.spec
    assert (f.num_draft_tokens, f.num_accepted_tokens) == (drafted, accepted)
    assert accepted > 0


def test_a_draft_model_reuses_a_cached_prefixs_draft_kv(tiny_llama, tiny_draft):
    """A draft model paged through the target's block table reuses the draft K/V a finished request wrote for the
    cached prefix (its first catch-up on turn 2 starts past the reused blocks, not at 0), and drafts exactly what a
    draft computing that prefix itself drafts."""
    spec = {
        "method": "draft_model",
        "model": tiny_draft,
        "num_speculative_tokens": 3,
        "enable_adaptive_verification": False,
    }
    prompt = {"prompt_token_ids": helpers.random_prompts(1, seed=4)[0]["prompt_token_ids"] * 4}
    cached = LLM(tiny_llama, max_model_len=256, speculative_config=spec)
    first = cached.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    follow = {"prompt_token_ids": prompt["prompt_token_ids"] + first + [7, 8, 9, 10]}

    def turn_two(llm: LLM) -> tuple[list[int], list[int], list[list[int]]]:
        proposer, starts, drafts = llm.engine.proposer, [], []
        run, propose = proposer.runner.run, proposer.propose

        def recorded_run(rows, *a, **kw):
            starts.append(rows[0].start)
            return run(rows, *a, **kw)

        def recorded_propose(reqs, k_max):
            out = propose(reqs, k_max)
            drafts.append(out.token_ids[0])
            return out

        proposer.runner.run, proposer.propose = recorded_run, recorded_propose
        return _ids(llm.generate([follow], GREEDY, use_tqdm=False))[0], starts, drafts

    out, starts, drafts = turn_two(cached)
    bs = cached.engine.cache.block_size
    # turn 1's prompt and answer: at least its prompt's full blocks were drafted
    assert starts[0] >= len(prompt["prompt_token_ids"]) // bs * bs > 0
    fresh = LLM(tiny_llama, max_model_len=256, speculative_config=spec, enable_prefix_caching=False)
    fresh_out, fresh_starts, fresh_drafts = turn_two(fresh)
    assert fresh_starts[0] == 0
    assert (out, drafts) == (fresh_out, fresh_drafts)
