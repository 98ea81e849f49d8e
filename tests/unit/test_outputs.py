"""SpecDecodeMetrics: one request's speculation figures from its verify steps (vLLM's per-request fields)."""

from __future__ import annotations

import pytest

from verispec.outputs import SpecDecodeMetrics


def test_from_steps_counts_positions_histogram_and_means():
    # K=3; a short draft (depth 2) at the third step
    m = SpecDecodeMetrics.from_steps([(3, 3), (3, 0), (2, 1), (3, 2)], 3, 11)
    assert (m.num_spec_steps, m.num_draft_tokens, m.num_accepted_tokens) == (4, 11, 6)
    assert m.acceptance_histogram == [1, 1, 1, 1]
    assert m.num_draft_tokens_per_pos == [4, 4, 3]
    assert m.num_accepted_tokens_per_pos == [3, 2, 1]
    assert m.acceptance_rate_per_pos == pytest.approx([0.75, 0.5, 1 / 3])
    assert m.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert m.draft_acceptance_rate == pytest.approx(6 / 11)
    assert m.per_step_accepted == [3, 0, 1, 2]
    j = m.to_json()
    assert j["num_accepted_draft_tokens"] == 6 and j["num_spec_tokens"] == 3 and "per_step_accepted" not in j
    assert m.to_json(detailed=True)["per_step_accepted"] == [3, 0, 1, 2]


def test_no_steps_and_combine():
    empty = SpecDecodeMetrics.from_steps([], 2, 0)
    assert empty.mean_acceptance_length == 1.0 and empty.draft_acceptance_rate == 0.0
    assert empty.acceptance_histogram == [0, 0, 0] and empty.acceptance_rate_per_pos == [0.0, 0.0]
    a = SpecDecodeMetrics.from_steps([(2, 2)], 2, 2)
    # a tree step: depth 3 (wider than K), more drafted nodes than its depth
    b = SpecDecodeMetrics.from_steps([(3, 1), (3, 3)], 2, 9)
    c = SpecDecodeMetrics.combine([a, empty, b])
    assert (c.num_spec_steps, c.num_draft_tokens, c.num_accepted_tokens) == (3, 11, 6)
    assert c.acceptance_histogram == [0, 1, 1, 1]
    assert c.num_draft_tokens_per_pos == [3, 3, 2] and c.num_accepted_tokens_per_pos == [3, 2, 1]
    assert c.per_step_accepted == [2, 1, 3]
