"""Per-request state (verispec/request.py)."""

from __future__ import annotations

import pytest

from verispec.request import Request
from verispec.sampling_params import SamplingParams


def test_tokens_per_step_starts_at_one_and_follows_the_decode_steps():
    r = Request("r", None, [1, 2, 3], SamplingParams(max_tokens=64), output_token_ids=[7])
    # the first token comes from the prompt's step: no decode step yet
    assert r.tokens_per_step() == 1.0
    # 12 tokens in 4 decode steps (drafts accepted), from 4 prior steps of one token
    r.output_token_ids += [8] * 12
    r.decode_steps = 4
    assert r.tokens_per_step() == pytest.approx(16 / 8)
    assert r.tokens_per_step(prior_steps=0) == 3.0
