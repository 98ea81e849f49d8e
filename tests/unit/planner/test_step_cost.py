"""The step-cost model (verispec/planner/step_cost.py): interpolation, online refinement, profile points, cache."""

from __future__ import annotations

import contextlib
import random
import time

import pytest

from verispec.planner import step_cost
from verispec.planner.step_cost import StepCostModel, load_or_profile, monotone_profile, profile_points


def test_interpolates_between_and_beyond_profile_points():
    m = StepCostModel({1: 1.0, 5: 2.0, 9: 4.0})
    assert m.cost(1) == 1.0
    assert m.cost(3) == pytest.approx(1.5)
    assert m.cost(7) == pytest.approx(3.0)
    assert m.cost(13) == pytest.approx(6.0)


def test_the_cost_table_is_cost_at_every_row_count():
    """table() gives what cost() gives for every row count, the fixed cost of verifying above the plain rows, as
    the fit moves and as larger tables are asked for."""
    model = StepCostModel({1: 1.0, 16: 2.0, 17: 2.6, 64: 5.0})
    for step in range(6):
        plain, most = (1, 8, 16, 16, 40, 3)[step], (9, 24, 20, 80, 64, 3)[step]
        table = model.table(plain, most)
        assert len(table) == most + 1
        assert table == [model.cost(r, drafted=r > plain) for r in range(most + 1)]
        model.observe(plain, 0.9 + 0.1 * step)
        model.observe(plain + 4, 1.6 + 0.2 * step, drafted=True)


def test_online_fit_learns_scale_then_overhead():
    m = StepCostModel({1: 1.0, 8: 2.0})
    # one row count only: what the steps add to the profile is a per-step overhead (attention over every request's
    # context, sampling), which an extra row does not grow
    for _ in range(20):
        m.observe(1, 2.0)
    assert m.a == 1.0 and m.cost(1) == pytest.approx(2.0) and m.cost(8) == pytest.approx(3.0)
    # steps faster than the profile: a scale down, never a negative overhead
    fast = StepCostModel({1: 1.0, 8: 2.0})
    for _ in range(20):
        fast.observe(1, 0.8)
    assert (
        fast.b == pytest.approx(0.0, abs=1e-12)
        and fast.cost(1) == pytest.approx(0.8)
        and fast.cost(8) == pytest.approx(1.6)
    )
    # steps of both sizes: measured = profile + 1.5 s of per-step overhead
    for _ in range(400):
        m.observe(1, 2.5)
        m.observe(8, 3.5)
    assert m.a == pytest.approx(1.0, rel=0.02) and m.b == pytest.approx(1.5, rel=0.05)
    assert m.cost(8) / m.cost(1) == pytest.approx(3.5 / 2.5, rel=0.02)


def test_online_fit_learns_the_fixed_cost_of_verifying():
    """measured = 1.2 * profile + 0.3 + 0.4 when the step verifies drafts, with noise: the rows' fit and the fixed
    cost come apart."""
    rng = random.Random(0)
    m = StepCostModel({1: 1.0, 16: 2.5, 32: 4.0})
    for _ in range(2000):
        drafted = rng.random() < 0.3
        rows = rng.randint(17, 24) if drafted else rng.randint(12, 16)
        m.observe(rows, 1.2 * m.profiled(rows) + 0.3 + 0.4 * drafted + rng.gauss(0, 0.05), drafted)
    assert m.a == pytest.approx(1.2, abs=0.05) and m.b == pytest.approx(0.3, abs=0.1)
    assert m.v == pytest.approx(0.4, abs=0.03)
    assert m.cost(20, drafted=True) - m.cost(16) == pytest.approx(
        1.2 * (m.profiled(20) - 2.5) + 0.4, abs=0.05
    )


def test_fixed_cost_of_verifying_with_one_plain_row_count():
    """A full batch of 16 that seldom verifies: plain steps all score 16 rows, so only the drafted steps' rows
    vary; the fixed cost is still found."""
    rng = random.Random(1)
    m = StepCostModel({1: 1.0, 16: 2.5, 32: 4.0})
    for i in range(3000):
        drafted = i % 10 == 0
        rows = 16 + rng.randint(1, 4) if drafted else 16
        m.observe(rows, 1.1 * m.profiled(rows) + 0.25 * drafted + rng.gauss(0, 0.05), drafted)
    assert m.v == pytest.approx(0.25, abs=0.05)
    assert m.cost(16) == pytest.approx(1.1 * 2.5, abs=0.03)


def test_a_fixed_cost_from_a_few_slow_steps_is_taken_in_part():
    """Three steps with drafts that ran at a slow moment (2x) among plain ones: the fixed cost of verifying they
    suggest is discounted (as if more steps had shown none), so that it cannot price verifying out before
    anything more is measured; steps that keep showing it bring it back."""
    m = StepCostModel({1: 1.0, 16: 2.5, 32: 4.0})
    for _ in range(50):
        m.observe(16, 2.5)
    for rows in (18, 19, 20):
        m.observe(rows, 2 * m.profiled(rows), drafted=True)
    # what the three steps add to a * profile + b
    raw = sum(m.profiled(r) for r in (18, 19, 20)) / 3 * (2 - m.a) - m.b
    assert 0 < m.v < 0.5 * raw
    for i in range(200):
        m.observe(16, 2.5)
        m.observe(17 + i % 4, m.profiled(17 + i % 4) + 0.3, drafted=True)
    assert m.v == pytest.approx(0.3, rel=0.1)


def test_no_fixed_cost_until_both_kinds_of_step_are_seen():
    m = StepCostModel({1: 1.0, 8: 2.0})
    for rows in range(2, 9):
        m.observe(rows, 1.5 * m.profiled(rows), drafted=True)
    assert m.v == 0.0 and m.a == pytest.approx(1.5)
    # one plain step is not yet a kind of step
    m.observe(1, 1.0)
    assert m.v == 0.0
    # steps with drafts cheaper than plain ones: no fixed cost, never a negative one
    m = StepCostModel({1: 1.0, 8: 2.0})
    for _ in range(50):
        m.observe(1, 1.0)
        m.observe(4, 0.9 * m.profiled(4), drafted=True)
    assert m.v == pytest.approx(0.0, abs=1e-12)


def test_noise_never_makes_more_rows_cheaper():
    m = StepCostModel({1: 1.0, 4: 1.5, 8: 2.0})
    for _ in range(50):
        m.observe(4, 1.0)
        m.observe(1, 1.4)
    assert m.cost(1) <= m.cost(4) <= m.cost(8)


def test_a_slow_outlier_in_the_profile_stays_one_point():
    # 17 rows timed during an interrupt: it takes the time measured at 18, not 18..25 the outlier's
    best = {16: 10.0, 17: 33.0} | {r: 11.0 + 0.1 * r for r in range(18, 26)}
    out = monotone_profile(best)
    assert out[17] == best[18] and out[25] == best[25]
    assert list(out.values()) == sorted(out.values())


def test_a_fast_outlier_in_the_profile_does_not_flatten_the_rows_below_it():
    # 20 rows timed while the VM briefly ran fast: the rows below it keep their slope (0.4 per row)
    best = {r: 10.0 + 0.4 * (r - 12) for r in range(12, 25)} | {20: 8.0}
    out = monotone_profile(best)
    assert out[20] == best[19] and out[12] == best[12] and out[15] - out[14] == pytest.approx(0.4)
    # a real step up (a tile filling at 17) stays
    tile = {r: 10.0 + 0.1 * r + (3.0 if r > 16 else 0.0) for r in range(12, 22)}
    assert monotone_profile(tile) == tile


def test_a_fast_stretch_is_pooled_not_spread_below():
    # 20 and 21 rows timed while the VM ran fast: pooled with their neighbours (least squares), where the least
    # time at or above each point would flatten 15..20 to 11.2
    best = {r: 10.0 + 0.4 * (r - 12) for r in range(12, 25)} | {20: 11.2, 21: 11.6}
    out = monotone_profile(best)
    assert [out[r] for r in (14, 15, 16, 17)] == pytest.approx([10.8, 11.2, 11.6, 12.0])
    assert out[21] == pytest.approx(12.0) and out[22] == best[22]
    assert list(out.values()) == sorted(out.values())


def test_rejects_an_empty_or_nonpositive_profile():
    with pytest.raises(ValueError, match="step-cost profile"):
        StepCostModel({})
    with pytest.raises(ValueError, match="step-cost profile"):
        StepCostModel({1: 0.0})


def test_profile_points_cover_every_draft_length_then_double():
    # 16 | 17: both sides of a row tile's edge
    assert profile_points(4, 32) == [1, 2, 3, 4, 5, 10, 16, 17, 20, 32]
    assert profile_points(4, 3) == [1, 2, 3]
    assert profile_points(0, 1) == [1]


def test_profile_points_cover_a_full_batch_and_its_first_drafts():
    points = profile_points(4, 80, batch_size=16)
    assert {16, 17, 18, 19, 20, 21} <= set(points)
    # tile edges up to 64 rows, then the doubling ladder
    assert {32, 33, 48, 49, 64, 65, 80} <= set(points) and 66 not in points
    assert profile_points(4, 18, batch_size=16) == [1, 2, 3, 4, 5, 10, 16, 17, 18]


class FakeRunner:
    """Counts forwards, each taking 2 ms + 0.2 ms per row + 0.5 ms per sequence after the first; the cache is big
    enough for the profile's context, and its copies are recorded."""

    class cache:
        t_alloc = 1024
        copies: list = []

        @classmethod
        def copy_prefix(cls, src, dst, n):
            cls.copies.append((src, list(dst), n))

        @staticmethod
        @contextlib.contextmanager
        def borrowed(slots, n):
            yield

    device = __import__("torch").device("cpu")

    def __init__(self):
        self.calls = 0

    def run(self, rows):
        self.calls += 1
        time.sleep(0.002 + 0.0002 * sum(len(r.token_ids) for r in rows) + 0.0005 * (len(rows) - 1))


def test_profiles_once_per_key_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    runner = FakeRunner()
    model, cached = load_or_profile(runner, 0, [1, 2, 4], ("model-a",))
    assert not cached and runner.calls > 0
    assert model.rows == [1, 2, 4]
    assert model.seconds == sorted(model.seconds)
    full = runner.calls
    _, cached = load_or_profile(runner, 0, [1, 2, 4], ("model-a",))
    # a cached profile costs two spot checks (and the context and warm-up forwards), not a profile
    assert cached and runner.calls - full < full
    _, cached = load_or_profile(runner, 0, [1, 2, 4], ("model-b",))
    assert not cached


def test_a_batch_step_prices_each_sequence_beyond_its_row(tmp_path, monkeypatch):
    """The batch step runs one row in each of the given slots behind copies of one context: each sequence after the
    first costs 0.5 ms beyond its row, and the cached profile keeps it."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    FakeRunner.cache.copies.clear()
    model, cached = load_or_profile(FakeRunner(), 0, [1, 2, 4], ("model-a",), batch_slots=[0, 1, 2, 3])
    assert not cached and FakeRunner.cache.copies == [(0, [1, 2, 3], 256)]
    # sleeps overshoot a little: within 0.3 ms of 0.5 ms
    assert model.seq_extra == pytest.approx(0.0005, abs=0.0003)
    assert model.plain_batch(4) == pytest.approx(model.profiled(4) + 3 * model.seq_extra)
    again, cached = load_or_profile(FakeRunner(), 0, [1, 2, 4], ("model-a",), batch_slots=[0, 1, 2, 3])
    assert cached and again.seq_extra == model.seq_extra
    # without slots for a batch (a batch of one): no per-sequence cost
    alone, _ = load_or_profile(FakeRunner(), 0, [1, 2, 4], ("model-a",))
    assert alone.seq_extra == 0.0 and alone.plain_batch(4) == alone.cost(4)


def test_a_long_first_round_leaves_the_cheap_points_their_repeats(monkeypatch):
    """A large batch's profile runs up to 256 rows, and one round of it can take the whole budget: the points the
    planner decides at (a few rows) are still timed every round, the dearest only once."""
    monkeypatch.setattr(step_cost, "_PROFILE_BUDGET_S", 0.02)
    counts: dict[int, int] = {}

    class CountingRunner(FakeRunner):
        def run(self, rows):
            n = sum(len(r.token_ids) for r in rows)
            counts[n] = counts.get(n, 0) + 1
            time.sleep(0.0002 * n)

    points = [1, 2, 3, 200]
    profile = step_cost.profile_step_cost(CountingRunner(), 0, points, repeats=4)
    assert profile[1] <= profile[2] <= profile[3] <= profile[200]
    # 1-3 rows four rounds each; 200 rows once after its warm-up forward
    assert [counts[r] for r in (1, 2, 3)] == [4, 4, 4] and counts[200] == 2
