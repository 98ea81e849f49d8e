"""Every method in SUPPORTED_METHODS keeps greedy output equal to plain decoding on a tiny model, and handles
requests added, aborted and finished mid-flight. A method added without a setup here fails, it is not skipped."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from tests.helpers import REPEATED_SPAN_PROMPTS
from verispec import LLM, SamplingParams
from verispec.proposers.factory import SUPPORTED_METHODS, draft_kv_share
from verispec.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class Setup:
    """How to run one method: the target fixture, the draft checkpoint fixture (if any) and the other keys."""

    target: str = "tiny_llama"
    draft: str | None = None
    keys: dict = field(default_factory=lambda: {"num_speculative_tokens": 3})
    # the method writes through a kv_transfer_config connector and drafts nothing
    kv_transfer: bool = False


SETUPS = {
    "ngram": Setup(keys={"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    "draft_model": Setup(draft="tiny_draft"),
    "suffix": Setup(keys={"num_speculative_tokens": 4}),
    "medusa": Setup(draft="tiny_medusa"),
    "mlp_speculator": Setup(draft="tiny_mlp_speculator"),
    "extract_hidden_states": Setup(keys={"num_speculative_tokens": 1}, kv_transfer=True),
    "eagle": Setup(draft="tiny_eagle"),
    "eagle3": Setup(draft="tiny_eagle3"),
    "mtp": Setup(target="tiny_mimo"),
    "dflash": Setup(draft="tiny_dflash"),
    "dspark": Setup(draft="tiny_dspark"),
    "custom_class": Setup(
        keys={"num_speculative_tokens": 3, "model": "tests.custom_proposer.RepeatLastToken"}
    ),
}

SAMPLING = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs():
    """Plain greedy token ids per target checkpoint, computed once."""
    cache: dict[str, list[list[int]]] = {}

    def get(target: str) -> list[list[int]]:
        if target not in cache:
            outs = LLM(target, max_model_len=256).generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)
            cache[target] = [o.outputs[0].token_ids for o in outs]
        return cache[target]

    return get


def _spec_llm(request, tmp_path, method: str, **engine_args) -> tuple[str, LLM]:
    assert method in SETUPS, f"method {method!r} is in SUPPORTED_METHODS but has no Setup in {__file__}"
    setup = SETUPS[method]
    target = request.getfixturevalue(setup.target)
    spec = {"method": method, **setup.keys}
    if setup.draft is not None:
        spec["model"] = request.getfixturevalue(setup.draft)
    kv = None
    if setup.kv_transfer:
        kv = {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        }
    engine_args = {"max_model_len": 256} | engine_args
    return target, LLM(target, speculative_config=spec, kv_transfer_config=kv, **engine_args)


def test_every_supported_method_has_a_setup():
    assert sorted(SETUPS) == sorted(SUPPORTED_METHODS)


@pytest.mark.parametrize("method", SUPPORTED_METHODS)
def test_greedy_output_equals_plain_decoding(request, tmp_path, plain_outputs, method):
    target, llm = _spec_llm(request, tmp_path, method)
    outs = llm.generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs(target), method
    drafted = llm.engine.counters.spec.num_draft_tokens
    if SETUPS[method].kv_transfer:
        assert drafted == 0, method
    else:
        assert drafted > 0, method


@pytest.mark.parametrize("method", SUPPORTED_METHODS)
def test_abort_mid_flight_leaves_the_other_requests_unchanged(request, tmp_path, plain_outputs, method):
    """Requests added, one aborted after two steps, the rest run to the end; then the freed slots serve a new
    batch: every output that finishes is plain decoding's."""
    target, llm = _spec_llm(request, tmp_path, method)
    engine = llm.engine
    for i, prompt in enumerate(REPEATED_SPAN_PROMPTS):
        engine.add_request(f"r{i}", None, prompt["prompt_token_ids"], SAMPLING)
    engine.step()
    engine.step()
    assert engine.abort_request("r1")
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    for rid in [*done, "r1"]:
        engine.release(rid)
    expected = plain_outputs(target)
    assert done == {f"r{i}": expected[i] for i in (0, 2, 3)}, method
    outs = llm.generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected, method


@pytest.mark.parametrize("method", SUPPORTED_METHODS)
def test_cached_prefixes_and_preemption_change_nothing(request, tmp_path, plain_outputs, method):
    """A second turn over the first's prompt and answer (its blocks come from the prefix cache, where the method
    can use them) and a KV pool too small for the batch (requests preempted and recomputed): plain decoding's
    output, turn after turn."""
    target, llm = _spec_llm(request, tmp_path, method)
    follow = [
        {"prompt_token_ids": p["prompt_token_ids"] + out + [5, 6, 7]}
        for p, out in zip(REPEATED_SPAN_PROMPTS, plain_outputs(target))
    ]
    plain = LLM(target, max_model_len=256, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(follow, SAMPLING, use_tqdm=False)]
    llm.generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)
    outs = llm.generate(follow, SAMPLING, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected, method
    if llm.engine.can_hit:
        assert llm.engine.counters.prefix_cache_hits > 0, method
    # a pool of 14 blocks of 16 tokens for 4 requests growing to 70-100 tokens: some are preempted and recomputed
    longer = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(follow, longer, use_tqdm=False)]
    cfg = plain.engine.runner.model.cfg
    # the target's share of the budget: a draft model's cache (paged through the target's block table) the rest
    budget = int(
        cfg.kv_bytes_per_token * 16 * 14.5 / (1 - draft_kv_share(llm.engine.speculative_config, cfg))
    )
    _, small = _spec_llm(request, tmp_path, method, max_model_len=128, kv_cache_memory_bytes=budget)
    assert small.engine.cache.pool.num_blocks == 15, method
    outs = small.generate(follow, longer, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected, method
    assert small.engine.counters.num_preemptions > 0, method


# a JSON schema whose keys and punctuation the grammar forces, a regex and a choice, one per request
GRAMMARS = [
    StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "n": {"type": "integer", "minimum": 0, "maximum": 999},
                "tag": {"enum": ["red", "green", "blue"]},
            },
            "required": ["name", "n", "tag"],
            "additionalProperties": False,
        },
        disable_any_whitespace=True,
    ),
    StructuredOutputsParams(regex=r"([0-9]{2}-[a-z]{1,3} ){2,4}"),
    StructuredOutputsParams(choice=["alpha beta gamma", "alpha beta delta", "omega"]),
    StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
]


def _under_grammars(llm: LLM, temperature: float = 0.0) -> list[list[int]]:
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=40, structured_outputs=g)
        for i, g in enumerate(GRAMMARS)
    ]
    outs = llm.generate(REPEATED_SPAN_PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", SUPPORTED_METHODS)
def test_structured_outputs_equal_plain_decoding_under_the_same_grammar(request, tmp_path, method):
    """Greedy and seeded sampled output under a grammar (drafts cut where it refuses them, tokens it forces drafted,
    its mask at every verified position) equals plain decoding's under the same grammar."""
    target, llm = _spec_llm(request, tmp_path, method)
    plain = LLM(target, max_model_len=256)
    for temperature in (0.0, 0.8):
        assert _under_grammars(llm, temperature) == _under_grammars(plain, temperature), (method, temperature)
    c = llm.engine.counters
    if not SETUPS[method].kv_transfer:
        assert c.spec.num_draft_tokens > 0 and c.grammar_forced_drafts > 0, method


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor_parallel_size=2 needs two usable cores")
@pytest.mark.parametrize("method", SUPPORTED_METHODS)
def test_tensor_parallel_speculation_equals_plain_under_the_same_layout(request, tmp_path, method):
    """TP=2 (a second rank process): speculative greedy output equals TP=2 plain decoding's, for every method (the
    drafters that share the target's LM head get a whole one on rank 0)."""
    target = request.getfixturevalue(SETUPS[method].target)
    plain = LLM(target, max_model_len=256, tensor_parallel_size=2)
    want = [o.outputs[0].token_ids for o in plain.generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)]
    plain.shutdown()
    _, llm = _spec_llm(request, tmp_path, method, tensor_parallel_size=2)
    outs = llm.generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want, method
    if not SETUPS[method].kv_transfer:
        assert llm.engine.counters.spec.num_draft_tokens > 0, method
    llm.shutdown()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="data_parallel_size=2 needs two usable cores")
@pytest.mark.parametrize("method", SUPPORTED_METHODS)
def test_data_parallel_speculation_equals_plain_decoding(request, tmp_path, plain_outputs, method):
    """DP=2 (two replica processes, requests routed between them): every method's greedy output is plain
    decoding's, as each replica is a whole engine."""
    target, llm = _spec_llm(request, tmp_path, method, data_parallel_size=2)
    outs = llm.generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs(target), method
    assert all(n > 0 for n in llm.engine.router.given), method
    if not SETUPS[method].kv_transfer:
        assert llm.engine.counters.spec.num_draft_tokens > 0, method
    llm.shutdown()
