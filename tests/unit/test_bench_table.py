"""verispec/bench.py's table: the end-to-end ceiling that prompt processing puts on every method."""

import pytest

from verispec.bench import BenchResult, print_table, prompt_ceiling


@pytest.fixture
def plain() -> BenchResult:
    # 4 s in all, 1 s of it in prompt steps
    return BenchResult("verispec plain", 4.0, 400, 100.0, prefill_seconds=1.0, decode_tok_per_s=133.0)


def test_the_ceiling_is_one_over_the_prompt_share(plain):
    assert prompt_ceiling(plain) == pytest.approx((0.25, 4.0))


def test_no_ceiling_without_timed_prompt_steps():
    # a peer engine reports no prefill split
    assert prompt_ceiling(BenchResult("llama.cpp", 2.0, 100, 50.0)) is None


def test_the_table_states_the_ceiling(plain, capsys):
    fast = BenchResult("verispec ngram", 2.0, 400, 200.0, prefill_seconds=1.0, decode_tok_per_s=400.0)
    print_table([plain, fast], plain)
    out = capsys.readouterr().out
    assert "prompt processing is 25% of the plain run" in out
    assert "4.00x" in out
