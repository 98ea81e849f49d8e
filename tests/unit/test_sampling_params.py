import numpy as np
import pytest

from verispec.sampling_params import SamplingParams


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.is_greedy and p.skip_special_tokens and not p.ignore_eos


@pytest.mark.parametrize(
    "kwargs, field, fragment",
    [
        ({"n": 0}, "n", "at least 1"),
        ({"temperature": -1.0}, "temperature", "temperature must be non-negative, got -1.0"),
        ({"temperature": float("nan")}, "temperature", "finite"),
        ({"temperature": float("inf")}, "temperature", "finite"),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "at least 1"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"min_p": 1.1}, "min_p", "[0, 1]"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": 3.0}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "greater than zero"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "greater than zero"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0"),
        ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "max_tokens=10"),
        ({"logprobs": -1}, "logprobs", "non-negative"),
        ({"seed": 1.5}, "seed", "integer"),
        ({"seed": "7"}, "seed", "integer"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"temperature": None}, "temperature", "number"),
        ({"top_p": True}, "top_p", "number"),
        ({"top_k": 2.5}, "top_k", "integer"),
        ({"n": "2"}, "n", "integer"),
        ({"max_tokens": 16.0}, "max_tokens", "integer"),
        ({"logprobs": 1.0}, "logprobs", "integer"),
        ({"ignore_eos": 1}, "ignore_eos", "bool"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens", "bool"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output", "bool"),
        ({"stop": 3}, "stop", "string"),
        ({"stop": ["a", 3]}, "stop", "string"),
        ({"stop": ["a", ""]}, "stop", "empty"),
        ({"stop_token_ids": [1, "x"]}, "stop_token_ids", "integer"),
        ({"stop_token_ids": 5}, "stop_token_ids", "list"),
        ({"stop_token_ids": [-3]}, "stop_token_ids", "non-negative"),
    ],
)
def test_validation_errors_name_the_field(kwargs, field, fragment):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert msg.startswith(field), msg
    assert fragment in msg, msg


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 2},
        {"top_p": 1},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0},
        {"min_p": 1},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 1e-3},
        {"max_tokens": 1},
        {"max_tokens": None, "min_tokens": 100},
        {"min_tokens": 16, "max_tokens": 16},
        {"logprobs": 0},
        {"seed": 0},
        {"n": np.int64(3), "max_tokens": np.int32(4), "temperature": np.float32(0.5)},
    ],
)
def test_valid_boundaries(kwargs):
    SamplingParams(**kwargs)


def test_numeric_normalisation():
    p = SamplingParams(temperature=1, top_p=np.float64(0.5), n=np.int64(2))
    assert type(p.temperature) is float and type(p.top_p) is float and type(p.n) is int


@pytest.mark.parametrize(
    "stop, expected",
    [(None, []), ("###", ["###"]), (["a", "b"], ["a", "b"]), (("x",), ["x"]), ([], [])],
)
def test_stop_normalised_to_list(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


def test_stop_token_ids():
    p = SamplingParams(stop_token_ids=[2, 5, 5], ignore_eos=True)
    assert p.stop_token_ids == [2, 5, 5]
    assert p.all_stop_token_ids == {2, 5}
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(np.int64(3),)).stop_token_ids == [3]


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_disabled_values_accepted(top_k):
    assert SamplingParams(top_k=top_k).top_k == top_k


def test_seed_minus_one_means_unseeded():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=1234).seed == 1234


@pytest.mark.parametrize("t, greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_is_greedy(t, greedy):
    assert SamplingParams(temperature=t).is_greedy is greedy


def test_is_plain_dataclass():
    a, b = SamplingParams(temperature=0.5, stop="x"), SamplingParams(temperature=0.5, stop=["x"])
    assert a == b
    # plain mutable dataclass
    a.max_tokens = 99
    assert a.max_tokens == 99
