"""Parallel sampling's fan-out (shared by LLM and the server): child ids and seeds, and the merge back."""

from __future__ import annotations

from verispec.engine.fanout import fan_out, merge
from verispec.outputs import CompletionOutput, RequestOutput
from verispec.sampling_params import SamplingParams


def test_n_1_keeps_the_request_as_it_is():
    sp = SamplingParams(seed=3, max_tokens=4)
    [r] = fan_out("7", "hi", [1, 2], sp)
    assert (r.request_id, r.prompt, r.prompt_token_ids) == ("7", "hi", [1, 2]) and r.params is sp


def test_children_get_ids_and_consecutive_seeds():
    reqs = fan_out("cmpl-1", None, [5], SamplingParams(n=3, seed=10, temperature=0.8))
    assert [r.request_id for r in reqs] == ["cmpl-1_0", "cmpl-1_1", "cmpl-1_2"]
    assert [r.params.seed for r in reqs] == [10, 11, 12] and all(r.params.n == 1 for r in reqs)
    assert all(r.params.temperature == 0.8 for r in reqs)
    assert [r.params.seed for r in fan_out("x", None, [5], SamplingParams(n=2))] == [None, None]


def test_merge_indexes_the_children_and_sums_the_draft_counts():
    def out(rid, text, drafted, accepted):
        comp = CompletionOutput(0, text, [1], finish_reason="length")
        return RequestOutput(rid, "p", [5], [comp], True, drafted, accepted)

    merged = merge([out("3_0", "a", 4, 2), out("3_1", "b", 6, 5)])
    assert merged.request_id == "3" and [c.text for c in merged.outputs] == ["a", "b"]
    assert [c.index for c in merged.outputs] == [0, 1]
    assert (merged.num_draft_tokens, merged.num_accepted_tokens) == (10, 7)
    single = out("4", "c", 0, 0)
    assert merge([single]) is single
