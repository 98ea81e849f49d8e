"""Stop rules (verispec/engine/stop.py): when a request's end is known in advance."""

from __future__ import annotations

from verispec.engine.request import Request
from verispec.engine.stop import known_tokens_left, may_end_early
from verispec.sampling_params import SamplingParams


def _request(eos: tuple[int, ...] = (2,), output: int = 3, **kw) -> Request:
    params = SamplingParams(temperature=0, **kw)
    return Request("r", None, [5, 6, 7, 8], params, eos_token_ids=eos, output_token_ids=[9] * output)


def test_only_a_length_limit_makes_the_end_known():
    assert known_tokens_left(_request(max_tokens=10, ignore_eos=True), 2048) == 7
    # the context ends first: 4 prompt + 3 output tokens of 12
    assert known_tokens_left(_request(max_tokens=10, ignore_eos=True), 12) == 5
    # no EOS id to stop at
    assert known_tokens_left(_request(eos=(), max_tokens=10), 2048) == 7
    # EOS, a stop token or a stop string may end it earlier
    assert known_tokens_left(_request(max_tokens=10), 2048) is None
    assert known_tokens_left(_request(max_tokens=10, ignore_eos=True, stop_token_ids=[4]), 2048) is None
    assert known_tokens_left(_request(max_tokens=10, ignore_eos=True, stop=["x"]), 2048) is None


def test_only_eos_and_stop_rules_end_a_request_early():
    assert may_end_early(_request(max_tokens=10))
    assert not may_end_early(_request(max_tokens=10, ignore_eos=True))
    assert not may_end_early(_request(eos=(), max_tokens=10))
    assert may_end_early(_request(eos=(), max_tokens=10, stop_token_ids=[4]))
    assert may_end_early(_request(eos=(), max_tokens=10, stop=["x"]))
