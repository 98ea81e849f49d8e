"""verispec/bench.py's interleaved rounds: engines take turns batch by batch, and each one's timed calls add up to
one result."""

from types import SimpleNamespace

import pytest

from verispec.bench import interleaved_round
from verispec.metrics import EngineCounters, SpecDecodingStats
from verispec.sampling_params import SamplingParams


class FakeLLM:
    """Records which prompts it ran, in a shared log; each call 'decodes' one token per prompt, one draft each."""

    def __init__(self, name: str, log: list, spec: bool):
        self.name, self.log = name, log
        self.engine = SimpleNamespace(counters=EngineCounters(spec=SpecDecodingStats(2) if spec else None))

    def reset_prefix_cache(self) -> bool:
        return True

    def generate(self, prompts, sp, use_tqdm=False):
        ids = [p["prompt_token_ids"] for p in prompts]
        c = self.engine.counters
        if sp.max_tokens == 4:
            # the warm-up: counted by the engine, not by the round
            c.decode_tokens += 100
            return []
        self.log.append((self.name, ids))
        c.decode_seconds += 0.5
        c.decode_tokens += len(ids)
        if c.spec is not None:
            c.spec.num_drafts += len(ids)
            c.spec.num_draft_tokens += 2 * len(ids)
            c.spec.num_accepted_tokens += len(ids)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[p[0]])]) for p in ids]


@pytest.fixture
def log() -> list:
    return []


@pytest.fixture
def engines(log):
    return [(name, FakeLLM(name, log, spec=name != "plain")) for name in ("plain", "a", "b")]


def test_every_engine_runs_every_batch_once_in_rotating_order(engines, log):
    prompts = [[i] for i in range(6)]
    interleaved_round(engines, prompts, SamplingParams(max_tokens=8), batch=2)
    assert len(log) == 9
    # batch j starts at engine j (mod 3), then the others in turn
    firsts = [log[3 * j][0] for j in range(3)]
    assert firsts == ["plain", "a", "b"]
    for j in range(3):
        turn = log[3 * j : 3 * j + 3]
        assert sorted(name for name, _ in turn) == ["a", "b", "plain"]
        assert all(ids == prompts[2 * j : 2 * j + 2] for _, ids in turn)


def test_a_turn_can_hold_more_prompts_than_a_batch(engines, log):
    prompts = [[i] for i in range(6)]
    interleaved_round(engines, prompts, SamplingParams(max_tokens=8), batch=2, per_turn=3)
    assert len(log) == 6
    assert [ids for _, ids in log[:3]] == [prompts[:3]] * 3 and [ids for _, ids in log[3:]] == [
        prompts[3:]
    ] * 3


def test_a_turn_needs_a_prompt(engines):
    with pytest.raises(ValueError, match="per_turn"):
        interleaved_round(engines, [[1]], SamplingParams(max_tokens=8), batch=2, per_turn=-1)


def test_each_engine_sums_its_own_calls(engines):
    prompts = [[i] for i in range(4)]
    timers = interleaved_round(engines, prompts, SamplingParams(max_tokens=8), batch=1)
    for name, _ in engines:
        res = timers[name].result()
        assert res.label == name and res.output_tokens == 4
        # the warm-up's tokens are not the round's
        assert res.decode_tok_per_s == pytest.approx(4 / 2.0)
        assert [o.outputs[0].token_ids for o in timers[name].outs] == prompts
    assert timers["a"].result().num_drafts == 4 and timers["a"].result().mean_acceptance_length == 2.0
    assert timers["plain"].result().num_drafts == 0


def test_engines_need_distinct_labels(log):
    twins = [("ngram", FakeLLM("a", log, True)), ("ngram", FakeLLM("b", log, True))]
    with pytest.raises(ValueError, match="distinct label"):
        interleaved_round(twins, [[1]], SamplingParams(max_tokens=8), batch=1)
