"""Stop rules (verispec/engine/stop.py): where a request may end, known in advance."""

from __future__ import annotations

from verispec.engine.stop import length_left, may_end_early
from verispec.request import Request
from verispec.sampling_params import SamplingParams


def _request(eos: tuple[int, ...] = (2,), output: int = 3, **kw) -> Request:
    params = SamplingParams(temperature=0, **kw)
    return Request("r", None, [5, 6, 7, 8], params, eos_token_ids=eos, output_token_ids=[9] * output)


def test_the_length_limit_is_max_tokens_or_the_context():
    assert length_left(_request(max_tokens=10), 2048) == 7
    # the context ends first: 4 prompt + 3 output tokens of 12
    assert length_left(_request(max_tokens=10), 12) == 5
    assert length_left(_request(max_tokens=None), 12) == 5


def test_only_eos_and_stop_rules_end_a_request_early():
    assert may_end_early(_request(max_tokens=10))
    assert not may_end_early(_request(max_tokens=10, ignore_eos=True))
    assert not may_end_early(_request(eos=(), max_tokens=10))
    assert may_end_early(_request(eos=(), max_tokens=10, stop_token_ids=[4]))
    assert may_end_early(_request(eos=(), max_tokens=10, stop=["x"]))
