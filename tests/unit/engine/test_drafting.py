"""A decode step's drafting under structured outputs, without a model: drafts cut where the grammar refuses a token
(one-hot drafts before it, drafts with a distribution after it), tokens the grammar forces appended within the cap,
and the step the planner learns from (the proposer's drafts only)."""

from __future__ import annotations

from verispec.engine.drafting import _grammar_cut, _grammar_forced
from verispec.engine.engine import _proposer_part
from verispec.request import Request
from verispec.sample.metadata import SpecDecodeMetadata, StepTokens
from verispec.sampling_params import SamplingParams


class Prefix:
    """A grammar admitting exactly the continuations of `text` (token = one character's code), forcing all of it."""

    def __init__(self, text: str):
        self.ids = [ord(c) for c in text]

    def valid_prefix(self, drafts: list[int]) -> int:
        n = 0
        while n < len(drafts) and n < len(self.ids) and drafts[n] == self.ids[n]:
            n += 1
        return n

    def forced(self, after: list[int]) -> list[int]:
        assert self.valid_prefix(after) == len(after)
        return self.ids[len(after) :]


def _req(rid: str, text: str | None) -> Request:
    r = Request(rid, None, [1, 2], SamplingParams())
    r.grammar = Prefix(text) if text is not None else None
    return r


def test_one_hot_drafts_stop_before_the_refused_token_others_after_it():
    reqs = [_req("a", "abc"), _req("b", None), _req("c", "xy")]
    drafts = [[ord("a"), ord("z"), ord("c")], [5, 6], [ord("x"), ord("y")]]
    cut, n = _grammar_cut(reqs, drafts, one_hot=True)
    assert cut == [[ord("a")], [5, 6], [ord("x"), ord("y")]] and n == 2
    # with a distribution the refused token stays, to be rejected (the residual is then sampled)
    cut, n = _grammar_cut(reqs, drafts, one_hot=False)
    assert cut == [[ord("a"), ord("z")], [5, 6], [ord("x"), ord("y")]] and n == 1


def test_forced_tokens_extend_the_drafts_within_each_cap():
    reqs = [_req("a", "abcdef"), _req("b", None), _req("c", "xy")]
    kept = {"a": [ord("a")], "b": [7], "c": []}
    added = _grammar_forced(reqs, kept, caps=[4, 8, 1])
    assert kept == {"a": [ord(c) for c in "abcd"], "b": [7], "c": [ord("x")]}
    assert added == 4


def test_the_planner_learns_from_the_proposers_drafts_only():
    spec = SpecDecodeMetadata([[1, 2, 3, 4], [5], []])
    step = StepTokens([[1, 2, 3, 4, 9], [8], [7]], [4, 0, 0], None, 5)
    learn_spec, learn_step = _proposer_part(spec, step, [2, 1, 0])
    assert learn_spec.draft_token_ids == [[1, 2], [5], []]
    assert learn_step.num_accepted == [2, 0, 0] and learn_step.tokens == step.tokens
    assert _proposer_part(spec, step, None) == (spec, step)
