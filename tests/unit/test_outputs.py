"""SpecDecodeMetrics: one request's speculation figures from its verify steps (vLLM's per-request fields)."""

from __future__ import annotations

import json

import pytest

from verispec.outputs import SpecDecodeMetrics

# vLLM's `metrics.speculative_decoding` keys at summary; detailed adds the two per-step arrays
VLLM_SUMMARY = {
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "acceptance_histogram",
    "acceptance_histogram_by_draft_length",
    "num_spec_steps",
    "num_accepted_draft_tokens",
    "num_draft_tokens",
    "num_spec_tokens",
}


def test_from_steps_counts_positions_histogram_and_means():
    # K=3; a short draft (depth 2) at the third step; (depth, drafted, accepted)
    m = SpecDecodeMetrics.from_steps([(3, 3, 3), (3, 3, 0), (2, 2, 1), (3, 3, 2)], 3)
    assert (m.num_spec_steps, m.num_draft_tokens, m.num_accepted_tokens) == (4, 11, 6)
    assert m.acceptance_histogram == m.histogram == [1, 1, 1, 1]
    assert m.acceptance_histogram_by_draft_length == {2: [0, 1, 0], 3: [1, 0, 1, 1]}
    assert m.num_draft_tokens_per_pos == [4, 4, 3]
    assert m.num_accepted_tokens_per_pos == [3, 2, 1]
    assert m.acceptance_rate_per_pos == pytest.approx([0.75, 0.5, 1 / 3])
    assert m.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert m.draft_acceptance_rate == pytest.approx(6 / 11)
    # summary keeps no per-step arrays
    assert (m.detailed, m.per_step_accepted, m.per_step_drafted) == (False, [], [])


def test_summary_and_detailed_json_carry_vllm_fields():
    steps = [(3, 3, 3), (3, 3, 0), (2, 2, 1), (3, 3, 2)]
    j = SpecDecodeMetrics.from_steps(steps, 3).to_json()
    assert VLLM_SUMMARY <= set(j) and not {"per_step_accepted", "per_step_drafted"} & set(j)
    assert j["num_accepted_draft_tokens"] == 6 and j["num_draft_tokens"] == 11 and j["num_spec_tokens"] == 3
    assert j["acceptance_histogram"] == [1, 1, 1, 1] and j["mean_acceptance_length"] == pytest.approx(2.5)
    # JSON object keys are strings, as vLLM sends them
    assert json.loads(json.dumps(j))["acceptance_histogram_by_draft_length"] == {
        "2": [0, 1, 0],
        "3": [1, 0, 1, 1],
    }
    d = SpecDecodeMetrics.from_steps(steps, 3, detailed=True).to_dict()
    assert d["per_step_accepted"] == [3, 0, 1, 2] and d["per_step_drafted"] == [3, 3, 2, 3]
    # vLLM's consistency rules between the fields
    assert d["num_spec_steps"] == sum(d["acceptance_histogram"]) == len(d["per_step_drafted"])
    assert d["num_accepted_draft_tokens"] == sum(j * c for j, c in enumerate(d["acceptance_histogram"]))
    assert d["num_draft_tokens"] == sum(d["per_step_drafted"])


def test_a_tree_step_drafts_more_tokens_than_its_depth():
    # depth 3 (wider than K=2), 7 nodes drafted, 2 accepted
    m = SpecDecodeMetrics.from_steps([(3, 7, 2)], 2, detailed=True)
    assert m.acceptance_histogram == [0, 0, 1, 0] and m.acceptance_histogram_by_draft_length == {
        7: [0, 0, 1] + [0] * 5
    }
    assert (m.num_draft_tokens, m.per_step_drafted, m.num_draft_tokens_per_pos) == (7, [7], [1, 1, 1])
    assert m.draft_acceptance_rate == pytest.approx(2 / 7)


def test_no_steps_and_combine():
    empty = SpecDecodeMetrics.from_steps([], 2, detailed=True)
    assert empty.mean_acceptance_length == 1.0 and empty.draft_acceptance_rate == 0.0
    assert empty.acceptance_histogram == [0, 0, 0] and empty.acceptance_rate_per_pos == [0.0, 0.0]
    assert empty.to_json()["per_step_accepted"] == [] and empty.acceptance_histogram_by_draft_length == {}
    a = SpecDecodeMetrics.from_steps([(2, 2, 2)], 2, detailed=True)
    # a tree step: depth 3 (wider than K), more drafted nodes than its depth
    b = SpecDecodeMetrics.from_steps([(3, 4, 1), (3, 5, 3)], 2, detailed=True)
    c = SpecDecodeMetrics.combine([a, empty, b])
    assert (c.num_spec_steps, c.num_draft_tokens, c.num_accepted_tokens) == (3, 11, 6)
    assert c.acceptance_histogram == [0, 1, 1, 1]
    assert c.acceptance_histogram_by_draft_length == {2: [0, 0, 1], 4: [0, 1, 0, 0, 0], 5: [0, 0, 0, 1, 0, 0]}
    assert c.num_draft_tokens_per_pos == [3, 3, 2] and c.num_accepted_tokens_per_pos == [3, 2, 1]
    assert (c.per_step_accepted, c.per_step_drafted, c.detailed) == ([2, 1, 3], [2, 4, 5], True)
    # a summary part: the combination has no per-step arrays to show
    mixed = SpecDecodeMetrics.combine([a, SpecDecodeMetrics.from_steps([(2, 2, 0)], 2)])
    assert (mixed.detailed, mixed.per_step_accepted) == (False, [])
    assert "per_step_accepted" not in mixed.to_json()
