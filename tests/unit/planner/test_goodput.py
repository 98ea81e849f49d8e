"""The goodput planner (verispec/planner/goodput.py): allocation, acceptance estimates, probing, schedules."""

from __future__ import annotations

import copy
import itertools

import pytest

from verispec.planner.acceptance import AcceptanceModel, expected_gains
from verispec.planner.goodput import (
    EARLY_END_PRIOR_TOKENS,
    IDLE_AFTER,
    IDLE_SKIP_MAX,
    PROBE_AFTER,
    PROBE_BUDGET,
    SHADOW_BUDGET,
    DraftPlanner,
    chance_to_run,
    closed_batch_worth,
    plan_lengths,
    schedule_cap,
)
from verispec.planner.step_cost import StepCostModel
from verispec.sample.metadata import SpecDecodeMetadata, StepTokens


def linear_cost(base: float, per_row: float):
    return lambda rows: base + per_row * rows


def brute_force(gains, step_cost, draft_cost=lambda k: 0.0, max_rows=None):
    """Every combination of per-request lengths: the best tokens-per-second ratio."""
    b = len(gains)
    best, best_rate = None, -1.0
    for ks in itertools.product(*[range(len(g) + 1) for g in gains]):
        if max_rows is not None and b + sum(ks) > max_rows:
            continue
        tokens = b + sum(sum(g[:k]) for g, k in zip(gains, ks))
        rate = tokens / (step_cost(b + sum(ks)) + draft_cost(max(ks, default=0)))
        if rate > best_rate + 1e-12:
            best, best_rate = list(ks), rate
    return best, best_rate


def rate_of(gains, ks, step_cost, draft_cost=lambda k: 0.0):
    b = len(gains)
    tokens = b + sum(sum(g[:k]) for g, k in zip(gains, ks))
    return tokens / (step_cost(b + sum(ks)) + draft_cost(max(ks, default=0)))


def test_expected_gains_are_running_products():
    assert expected_gains([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]
    assert expected_gains([]) == []


def test_free_rows_verify_every_draft_and_costly_rows_none():
    gains = [expected_gains([0.9] * 4)]
    # a row costs nothing: draft everything
    assert plan_lengths(gains, lambda rows: 1.0) == [4]
    # each extra row costs a whole plain step: no draft pays (gain < 1 per row)
    assert plan_lengths(gains, lambda rows: float(rows)) == [0]


def test_the_plan_matches_brute_force_on_random_batches():
    import random

    rng = random.Random(0)
    for _ in range(200):
        b = rng.randint(1, 3)
        gains = [expected_gains([rng.random() for _ in range(rng.randint(0, 4))]) for _ in range(b)]
        cost = linear_cost(rng.uniform(0.5, 2.0), rng.uniform(0.0, 0.6))
        max_rows = rng.choice([None, b + rng.randint(0, 6)])
        got = plan_lengths(gains, cost, max_rows=max_rows)
        _, best_rate = brute_force(gains, cost, max_rows=max_rows)
        assert rate_of(gains, got, cost) == pytest.approx(best_rate, rel=1e-9)
        assert all(0 <= k <= len(g) for k, g in zip(got, gains))
        if max_rows is not None:
            assert b + sum(got) <= max_rows


def test_the_early_stop_keeps_the_plan_exact_with_stepped_costs_and_the_speedup():
    """The scan stops once the gains left cannot pay for the next row; against every prefix of the greedy order
    (what the scan without the stop would try) the plan is the same, with tile-like jumps in the step cost, a
    drafting cost that is not monotone in the draft length, and the long-run criterion (speedup)."""
    import random

    rng = random.Random(1)
    for _ in range(300):
        b = rng.randint(1, 4)
        gains = [expected_gains([rng.random() for _ in range(rng.randint(0, 5))]) for _ in range(b)]
        tile, jump, per_row = rng.choice([2, 3, 16]), rng.uniform(0.0, 0.8), rng.uniform(0.0, 0.3)

        def cost(rows, tile=tile, jump=jump, per_row=per_row):
            return 1.0 + per_row * rows + jump * ((rows - 1) // tile)

        table = [0.0] + [rng.uniform(0.0, 0.2) for _ in range(6)]
        draft = table.__getitem__
        speedup = rng.choice([None, 0.8, 1.0, 1.5, 3.0])
        got = plan_lengths(gains, cost, draft, discount=0.9, speedup=speedup)
        # every prefix of the greedy order, scored as the plan scores it
        order = sorted(((g, i) for i, row in enumerate(gains) for g in row), key=lambda t: -t[0])
        r = None if speedup is None else max(speedup, 1.0) * b / cost(b)
        best_ks, best = [0] * b, b / cost(b) if r is None else b - r * cost(b)
        for n in range(1, len(order) + 1):
            ks = [0] * b
            for _, i in order[:n]:
                ks[i] += 1
            tokens = b + 0.9 * sum(g for g, _ in order[:n])
            seconds = cost(b + n) + draft(max(ks))
            v = tokens / seconds if r is None else tokens - r * seconds
            if v > best + 1e-12:
                best_ks, best = ks, v
        assert got == best_ks


def test_draft_cost_can_make_drafting_not_pay():
    gains = [expected_gains([0.7] * 4)]
    cheap = plan_lengths(gains, linear_cost(1.0, 0.05))
    costly = plan_lengths(gains, linear_cost(1.0, 0.05), draft_cost=lambda k: 0.6 * k)
    assert cheap == [4]
    assert costly[0] < cheap[0]


def test_likely_requests_get_the_rows_first():
    gains = [expected_gains([0.95] * 4), expected_gains([0.2] * 4)]
    ks = plan_lengths(gains, linear_cost(1.0, 0.1))
    assert ks[0] >= 3 and ks[1] == 0


def test_base_rows_count_requests_that_do_not_speculate():
    gains = [expected_gains([0.5] * 2)]
    cost = linear_cost(0.0, 1.0)
    # alone, one row per step: a draft with gain 0.5 costs a whole row
    assert plan_lengths(gains, cost) == [0]
    # with rows that are cheap in aggregate (a fixed overhead dominates) it pays
    assert plan_lengths(gains, lambda rows: 10.0 + 0.1 * rows, base_rows=8) == [2]


def test_discounted_gains_must_pay_for_the_rows():
    """A draft that barely pays is verified at its full expected gain and not at 90% of it; one that pays well is
    either way; where rows are free any gain pays."""
    cost = linear_cost(1.0, 0.1)
    # plain rate 1 / 1.1; one draft: (1 + g) / 1.2, which pays for g > 1 / 11
    assert plan_lengths([[0.095]], cost) == [1]
    assert plan_lengths([[0.095]], cost, discount=0.9) == [0]
    assert plan_lengths([[0.2]], cost, discount=0.9) == [1]
    assert plan_lengths([[0.01]], linear_cost(1.0, 0.0), discount=0.9) == [1]


def test_schedule_cap():
    schedule = ((1, 4, 4), (5, 16, 2), (17, 64, 0))
    assert [schedule_cap(schedule, b, 7) for b in (1, 4, 5, 16, 17, 64, 65)] == [4, 4, 2, 2, 0, 0, 0]
    assert schedule_cap(None, 3, 5) == 5


def test_schedule_cap_fills_gaps_with_the_previous_range_and_clamps_to_the_cap():
    """vLLM's lookup: a batch size between two ranges (or past the last) takes the previous range's K, and a K
    above num_speculative_tokens is clamped to it."""
    schedule = ((1, 4, 9), (17, 32, 1), (64, 64, 3))
    sizes = (1, 4, 5, 16, 17, 33, 63, 64, 500)
    assert [schedule_cap(schedule, b, 5) for b in sizes] == [5, 5, 5, 5, 1, 1, 1, 3, 3]
    # the order the ranges were given in does not matter
    assert [schedule_cap(schedule[::-1], b, 5) for b in sizes] == [5, 5, 5, 5, 1, 1, 1, 3, 3]


def test_acceptance_learns_a_requests_history():
    model = AcceptanceModel(num_positions=4)
    prior = model.conditional("a", 4)
    for _ in range(30):
        model.observe("a", 4, 4)
        model.observe("b", 4, 0)
    a, b = model.conditional("a", 4), model.conditional("b", 4)
    # b's drafts fail at the first position; its deeper ones were never judged (the shared estimate, capped)
    assert a[0] > b[0] and all(x >= y for x, y in zip(a, b))
    assert a[0] > prior[0] and b[0] < prior[0]
    assert all(0.0 < x < 1.0 for x in a + b)
    # a new request starts from the shared (method) estimate
    c = model.conditional("c", 4)
    assert b[0] < c[0] < a[0] or c[0] == pytest.approx(model.positions[0].value(), rel=1e-9)


def test_memoised_estimates_follow_every_observation():
    """conditional() is memoised per request; any observation (its own, another request's, a tree's) gives the
    estimates a fresh model would."""
    model = AcceptanceModel(num_positions=4)
    first = model.conditional("a", 4)
    model.observe("a", 2, 1)
    assert model.conditional("a", 4) != first
    for step in range(20):
        before = model.conditional("a", 3)
        model.observe("b", 4, step % 3)
        after = model.conditional("a", 3)
        # b's outcomes move the shared estimates that a's are built on
        assert after != before
        model._values = None
        model.requests["a"].memo = None
        assert model.conditional("a", 3) == after
    model.observe_tree([0, 0, 1], [0, 1, 2], [0.9, 0.3], [True, True, False])
    fresh = model.conditional("a", 4)
    model.requests["a"].memo = None
    assert model.conditional("a", 4) == fresh
    # drafts with confidence teach its bins and the shared position estimates too (what the ask reads before a
    # request's drafts exist): any request's replace a's memo
    for who in ("b", "a"):
        memo = model.requests["a"].memo
        model.observe(who, 3, 1, [0.9, 0.5, 0.2])
        got = model.conditional("a", 4)
        assert model.requests["a"].memo is not memo
        model._values = None
        model.requests["a"].memo = None
        assert model.conditional("a", 4) == got
    # the expected gains follow the same way, at any length
    for k in (2, 4, 1, 3):
        assert model.gains("a", k) == expected_gains(model.conditional("a", k))
        model.observe("a", 3, k % 3)
        assert model.gains("a", k) == expected_gains(model.conditional("a", k))


def test_positions_past_the_first_rejection_teach_nothing():
    model = AcceptanceModel(num_positions=4)
    before = [r.trials for r in model.positions]
    model.observe("a", 4, 1)
    after = [r.trials for r in model.positions]
    assert after[0] > before[0] and after[1] > before[1]
    assert after[2] == before[2] and after[3] == before[3]


def test_confidence_is_calibrated_per_bin():
    model = AcceptanceModel(num_positions=4)
    # the proposer says 0.9 but only half of such drafts are accepted
    for i in range(400):
        model.observe(f"r{i}", 1, i % 2, confidence=[0.9])
    est = model.confidence[0][9].value()
    assert est == pytest.approx(0.5, abs=0.1)
    # an untouched bin keeps its centre
    assert model.confidence[0][2].value() == pytest.approx(0.25)


def test_confidence_is_calibrated_per_draft_position():
    """The same stated confidence can mean a likely first draft and an unlikely third one."""
    model = AcceptanceModel(num_positions=4)
    # first drafts at 0.5 always accepted, second ones at 0.5 never, third ones untouched
    for i in range(400):
        model.observe(f"r{i}", 2, 1, confidence=[0.5, 0.5])
    first, second, third = model.conditional("new", 3, [0.5, 0.5, 0.5])
    assert first > 0.9 and second < 0.1 and third == pytest.approx(0.55)


class FixedCost(StepCostModel):
    def __init__(self, per_row: float):
        super().__init__({1: 1.0, 64: 1.0 + 63 * per_row})


def hopeless(planner: DraftPlanner, ids) -> None:
    """Every request in ids has had all its drafts rejected, long enough that a first draft's estimated gain is
    about 1% of a token (so a row that costs 1.5% of a step does not pay)."""
    for rid in ids:
        for _ in range(1000):
            planner.observe(rid, 4, 0)


def test_planner_probes_a_request_it_keeps_skipping():
    # a row costs 1.5% of a step: within the probe budget, so the probe runs as soon as it is due
    planner = DraftPlanner(4, FixedCost(0.015), drafter_runs_forward=False, max_rows=64)
    hopeless(planner, "a")
    chosen = [planner.choose(["a"], [[1, 2, 3, 4]], None, 1, 0.0)[0] for _ in range(PROBE_AFTER + 1)]
    assert chosen[:PROBE_AFTER] == [0] * PROBE_AFTER
    assert chosen[PROBE_AFTER] == 1


@pytest.mark.parametrize(
    "profile",
    [
        {1: 1.0, 64: 1.0 + 63 * 0.015},
        {1: 1.0, 64: 1.0 + 63 * 0.9},
        # an AMX-like tile: up to 16 rows cost the same, the 17th starts another tile
        {1: 1.0, 16: 1.0, 17: 1.9, 32: 1.9, 33: 2.8, 64: 2.8},
    ],
)
def test_probes_spend_at_most_their_budget(profile):
    """Over many steps, what the probes add to the steps stays within PROBE_BUDGET of the steps' cost (plus the
    one probing step that may run on credit kept), however dear an extra row is, and probes still happen."""
    cost = StepCostModel(profile)
    ids = [f"r{i}" for i in range(16)]
    planner = DraftPlanner(4, cost, drafter_runs_forward=False, max_rows=64)
    hopeless(planner, ids)
    spent = total = 0.0
    probes = 0
    for _ in range(600):
        chosen = planner.choose(ids, [[1, 2, 3, 4]] * 16, None, 16, 0.0)
        n = sum(chosen)
        probes += n
        total += cost.cost(16)
        spent += cost.cost(16 + n) - cost.cost(16)
    assert probes > 0
    assert spent <= PROBE_BUDGET * total + cost.cost(32) - cost.cost(16)


# the drafting time measured, not patched out
@pytest.mark.row_cost(None)
def test_a_drafter_with_a_forward_pays_for_its_probes():
    """A probe of a drafter with a forward of its own (EAGLE, a draft model) also costs its drafting for the probed
    request: reading the positions committed since it last drafted for it (its prompt at first), then the draft.
    Probes wait until the credit covers all of it, so rows, reading and drafting together stay within
    PROBE_BUDGET of the steps."""
    cost = FixedCost(0.015)
    ids = [f"r{i}" for i in range(16)]
    planner = DraftPlanner(4, cost, drafter_runs_forward=True, max_rows=64)
    hopeless(planner, ids)
    # a draft for one request costs a tenth of a plain step over the batch, reading 50 positions one more
    each, per_position = cost.cost(16) / 10, cost.cost(16) / 500
    # positions each request's drafter has not read: a prompt of 100 at first
    backlog = dict.fromkeys(ids, 100)
    spent = total = 0.0
    probes = 0
    for step in range(1600):
        ask = planner.ask(ids, [4] * 16, 16, backlog=[backlog[r] for r in ids])
        asked = [r for r, k in zip(ids, ask) if k]
        read = sum(backlog[r] for r in asked)
        drafting = len(asked) * each + read * per_position
        if asked:
            planner.observe_draft_time(max(ask), drafting, read)
        chosen = planner.choose(ids, [[1] * k for k in ask], None, 16, drafting)
        assert chosen == ask
        for r in ids:
            backlog[r] = 1 if r in asked else backlog[r] + 1
        # once the reading and the drafting have been measured
        if step >= 4 * PROBE_AFTER:
            probes += len(asked)
            total += cost.cost(16)
            spent += cost.cost(16 + len(asked)) - cost.cost(16) + drafting
    # (learned from asks that read many positions, some drafting included)
    assert per_position <= planner.read_seconds < 2 * per_position
    assert probes > 0
    # (plus one probe run on credit kept)
    assert spent <= PROBE_BUDGET * total + cost.cost(17) - cost.cost(16) + each + 150 * per_position


# the drafting time measured, not patched out
@pytest.mark.row_cost(None)
def test_a_drafters_reading_is_priced_per_position():
    """A drafter with a forward of its own reads a request's positions committed since it last drafted for it (a
    prompt at first) before drafting. The planner learns the seconds per position from an ask that read many,
    keeps the drafting time net of reading, and prices each request's backlog: of two requests with the same
    history, the one whose backlog would take longer to read than its drafts save is not asked (over the steps it
    has left, at most _READ_HORIZON: reading once serves the drafts after it)."""
    planner = DraftPlanner(3, FixedCost(0.0), drafter_runs_forward=True, max_rows=64)
    # (one request drafts first: test_a_drafter_with_a_forward_drafts_for_one_request_until_its_times_are_known)
    assert planner.ask(["a", "b"], [3, 3], 2, backlog=[500, 500]) == [3, 0]
    # a prompt read at 1 ms a position
    planner.observe_draft_time(3, 0.5, read=500)
    assert planner.read_seconds == pytest.approx(0.001)
    assert planner.draft_cost(3) == 0.0
    # a step that read each request's newest token: drafting itself took 10 ms
    planner.ask(["a", "b"], [3, 3], 2, backlog=[1, 1])
    planner.observe_draft_time(3, 0.012, read=2)
    assert planner.draft_cost(3) == pytest.approx(0.010)
    # an ask that read a long backlog teaches the reading, not the drafting
    planner.ask(["a", "b"], [3, 3], 2, backlog=[1, 200])
    planner.observe_draft_time(3, 0.211, read=201)
    assert planner.read_seconds == pytest.approx(0.001)
    assert planner.draft_cost(3) == pytest.approx(0.010)
    # a plain step costs 1 s; reading b's 5000 positions would cost 5
    a, b = planner.ask(["a", "b"], [3, 3], 2, backlog=[1, 5000])
    assert a > 0 and b == 0
    assert planner.ask(["a", "b"], [3, 3], 2) == [a, a]
    # reading once serves later drafts: spread over 16 of its steps left, b's reading costs 0.31 s a step
    assert planner.ask(["a", "b"], [3, 3], 2, backlog=[1, 5000], steps_left=[5000, 5000]) == [a, a]
    # over two steps left, 2.5 s a step
    assert planner.ask(["a", "b"], [3, 3], 2, backlog=[1, 5000], steps_left=[2, 2]) == [a, 0]


def test_dear_probes_wait_and_run_together():
    """When the 17th row starts another AMX tile, one probe costs as much as sixteen: due requests wait until the
    credit covers the tile, then probe in the same step."""
    cost = StepCostModel({1: 1.0, 16: 1.0, 17: 1.9, 32: 1.9, 33: 2.8, 64: 2.8})
    ids = [f"r{i}" for i in range(16)]
    planner = DraftPlanner(4, cost, drafter_runs_forward=False, max_rows=64)
    hopeless(planner, ids)
    steps = [sum(planner.choose(ids, [[1, 2, 3, 4]] * 16, None, 16, 0.0)) for _ in range(200)]
    probing = [n for n in steps if n]
    assert probing and all(n == 16 for n in probing)
    # the first waits until PROBE_BUDGET of the steps covers the tile's 0.9
    assert steps.index(16) >= 0.9 / PROBE_BUDGET - 1


def test_cheap_probes_spread_over_steps():
    """Where an extra row is cheap, a request probes as soon as it is due: requests that went idle at different
    steps probe on different steps (no step carries them all)."""
    planner = DraftPlanner(4, FixedCost(0.015), drafter_runs_forward=False, max_rows=64)
    hopeless(planner, "abc")
    probes: dict[int, list[int]] = {}
    for step in range(3 * PROBE_AFTER):
        # requests join one after another
        ids = ["a", "b", "c"][: 1 + min(2, step // 5)]
        chosen = planner.choose(ids, [[1, 2, 3, 4]] * len(ids), None, len(ids), 0.0)
        if any(chosen):
            probes[step] = chosen
    # each after PROBE_AFTER skipped steps of its own
    assert sorted(probes) == [16, 21, 26, 33, 38, 43]
    assert all(sum(c) == 1 for c in probes.values())


def test_the_fixed_cost_of_verifying_falls_on_the_first_draft():
    """A row costs 0.01 on a step of 1.15, and a step that verifies anything pays 0.1 more: one draft likely to be
    accepted pays for its row but not for the fixed cost; sixteen of them pay for both."""
    cost = FixedCost(0.01)
    cost.v = 0.1
    assert plan_lengths([[0.3]] + [[]] * 15, cost_of(cost, 16), base_rows=16) == [0] * 16
    assert plan_lengths([[0.3]] * 16, cost_of(cost, 16), base_rows=16) == [1] * 16
    cost.v = 0.0
    assert plan_lengths([[0.3]] + [[]] * 15, cost_of(cost, 16), base_rows=16)[0] == 1


def cost_of(model: StepCostModel, plain_rows: int):
    return lambda rows: model.cost(rows, drafted=rows > plain_rows)


def test_planner_asks_forward_drafters_only_for_what_it_will_verify():
    planner = DraftPlanner(4, FixedCost(0.9), drafter_runs_forward=True, max_rows=64)
    for _ in range(40):
        planner.observe("a", 4, 0)
    assert planner.ask(["a"], [4], 1) == [0]
    # a drafter without a forward drafts its whole cap wherever some drafting pays (its confidence trims later)
    cheap = DraftPlanner(4, FixedCost(0.1), drafter_runs_forward=False, max_rows=64)
    assert cheap.ask(["a"], [4], 1) == [4]
    # and nothing where none does
    cheap = DraftPlanner(4, FixedCost(0.9), drafter_runs_forward=False, max_rows=64)
    for _ in range(40):
        cheap.observe("a", 4, 0)
    assert cheap.ask(["a"], [4], 1) == [0]


def test_planner_reports_mean_k_and_row_cost():
    planner = DraftPlanner(4, FixedCost(0.25), drafter_runs_forward=False, max_rows=64)
    for _ in range(20):
        planner.observe("a", 4, 4)
    planner.choose(["a"], [[1, 2, 3, 4]], None, 1, 0.0)
    assert planner.mean_chosen_k == 4.0
    assert planner.verified_row_cost() == pytest.approx(0.25)


# the suite's planner fixture makes drafting free; this test times it
@pytest.mark.row_cost(None)
def test_drafting_time_of_a_requests_first_step_is_not_its_cost():
    """A request's first ask includes its drafter's catch-up over the prompt (a draft model's prefill): that time
    is not recorded as the cost of drafting k tokens, or k would look dear and never be asked for again."""
    planner = DraftPlanner(3, FixedCost(0.0), drafter_runs_forward=True, max_rows=64)
    assert planner.ask(["a"], [3], 1) == [3]
    planner.observe_draft_time(3, 100.0)
    assert planner.draft_cost(3) == 0.0
    assert planner.ask(["a"], [3], 1) == [3]
    planner.observe_draft_time(3, 0.1)
    assert planner.draft_cost(3) == pytest.approx(0.1)
    # a request joining later: its first step is left out too
    planner.ask(["a", "b"], [3, 3], 2)
    planner.observe_draft_time(3, 100.0)
    assert planner.draft_cost(3) == pytest.approx(0.1)


# the drafting time measured, not patched out
@pytest.mark.row_cost(None)
def test_a_drafter_with_a_forward_drafts_for_one_request_until_its_times_are_known():
    """Before any drafting time is measured, the plan would have the whole batch read its prompts at once (a draft
    model's prefill of every prompt) at a cost it cannot know: one request drafts first (the one with the least to
    read) until the reading and the drafting have been timed, then the plan takes them all."""
    planner = DraftPlanner(3, FixedCost(0.0), drafter_runs_forward=True, max_rows=64)
    ids = ["a", "b", "c", "d"]
    first = planner.ask(ids, [3] * 4, 4, backlog=[100, 50, 80, 60])
    assert [bool(k) for k in first] == [False, True, False, False]
    # its prompt's reading: the seconds per position
    planner.observe_draft_time(max(first), 0.05, read=50)
    second = planner.ask(ids, [3] * 4, 4, backlog=[101, 2, 81, 61])
    assert [bool(k) for k in second] == [False, True, False, False]
    # a step that read little: the drafting time
    planner.observe_draft_time(max(second), 0.004, read=2)
    assert all(planner.ask(ids, [3] * 4, 4, backlog=[102, 1, 82, 62], steps_left=[1000] * 4))
    # probes too: requests due together probe one at a time until the times are known
    probing = DraftPlanner(3, FixedCost(0.015), drafter_runs_forward=True, max_rows=64)
    hopeless(probing, ids)
    asks = []
    for _ in range(PROBE_AFTER + 1):
        ask = probing.ask(ids, [3] * 4, 4, backlog=[100, 50, 80, 60])
        probing.choose(ids, [[1] * k for k in ask], None, 4, 0.0)
        asks.append(ask)
    assert asks[-1] == [0, 1, 0, 0] and not any(map(any, asks[:-1]))


def test_a_request_the_ask_keeps_skipping_is_probed():
    """The ask gives a cheap drafter nothing to draft where drafting does not pay, so the step has no drafts to
    choose from: those steps still count as skipped, and the request is probed after PROBE_AFTER of them."""
    planner = DraftPlanner(4, FixedCost(0.015), drafter_runs_forward=False, max_rows=64)
    hopeless(planner, "a")
    chosen = []
    for _ in range(2 * PROBE_AFTER):
        ask = planner.ask(["a"], [4], 1)
        drafts = [[1, 2, 3, 4][: ask[0]]]
        chosen.append(planner.choose(["a"], drafts, None, 1, 0.0)[0])
    assert chosen.count(1) == 1 and chosen[PROBE_AFTER] == 1


def test_shadow_drafts_replace_probes():
    """With shadow drafts a request the planner skips is never probed with a paid row: its drafts wait to be
    judged against what it commits instead."""
    planner = DraftPlanner(4, FixedCost(0.015), drafter_runs_forward=False, max_rows=64, shadow_drafts=True)
    hopeless(planner, "a")
    chosen = [planner.choose(["a"], [[1, 2, 3, 4]], None, 1, 0.0)[0] for _ in range(3 * PROBE_AFTER)]
    assert chosen == [0] * (3 * PROBE_AFTER)
    assert planner.shadows["a"].drafts == [1, 2, 3, 4]


def test_shadow_drafts_teach_what_verifying_them_would():
    """Drafts judged against the committed tokens, one token per step, leave the acceptance model where verifying
    them would have: 2 of 4 accepted, the third rejected, the fourth never judged."""
    # rows as dear as a step: even confident drafts are not verified
    shadowed = DraftPlanner(4, FixedCost(1.0), drafter_runs_forward=False, max_rows=64, shadow_drafts=True)
    verified = AcceptanceModel(num_positions=4)
    for model in (shadowed.acceptance, verified):
        for _ in range(1000):
            model.observe("a", 4, 0)
    assert shadowed.choose(["a"], [[5, 6, 7, 8]], [[0.9, 0.8, 0.7, 0.6]], 1, 0.0) == [0]
    for tok in (5, 6, 9):
        shadowed.committed("a", [tok])
    verified.observe("a", 4, 2, confidence=[0.9, 0.8, 0.7, 0.6])
    assert "a" not in shadowed.shadows
    for conf in (None, [0.9, 0.8, 0.7, 0.6]):
        assert shadowed.acceptance.conditional("a", 4, conf) == verified.conditional("a", 4, conf)
    # the committed token after the judged ones teaches nothing
    shadowed.committed("a", [8])
    assert shadowed.acceptance.conditional("a", 4) == verified.conditional("a", 4)


def test_the_bonus_token_judges_the_first_draft_not_verified():
    """A step that verifies 2 of 4 one-hot drafts and accepts both commits the target's own token next: it is the
    outcome of verifying draft 3, so the model learns position 3 as if it had been verified. A rejection before it,
    or drafts with a distribution, teach nothing past the verified ones."""
    conf = [0.9, 0.8, 0.7, 0.6]
    for bonus, hit in ((7, True), (9, False)):
        # a row costs half a step: the planner verifies 2 of these drafts
        planner = DraftPlanner(4, FixedCost(0.6), drafter_runs_forward=False, max_rows=64, shadow_drafts=True)
        verified = AcceptanceModel(num_positions=4)
        for model in (planner.acceptance, verified):
            for _ in range(1000):
                model.observe("a", 2, 2, confidence=conf)
        k = planner.choose(["a"], [[5, 6, 7, 8]], [conf], 1, 0.0)[0]
        assert 0 < k < 4
        planner.observe("a", k, k, conf, [5, 6, 7, 8][:k] + [bonus])
        verified.observe("a", k + 1, k + int(hit), conf)
        assert planner.acceptance.conditional("a", 4, conf) == verified.conditional("a", 4, conf)
    before = planner.acceptance.conditional("a", 4, conf)
    k = planner.choose(["a"], [[5, 6, 7, 8]], [conf], 1, 0.0)[0]
    # a rejected draft: the rest were never reached
    planner.observe("a", k, k - 1, conf, [5, 6, 7, 8][: k - 1] + [1])
    verified.observe("a", k, k - 1, conf)
    assert planner.acceptance.conditional("a", 4, conf) == verified.conditional("a", 4, conf) != before
    planner.choose(["a"], [[5, 6, 7, 8]], [conf], 1, 0.0, one_hot=False)
    assert planner.next_draft == {}


def test_a_skipped_request_that_turns_predictable_is_verified_again_within_a_few_steps():
    """Where the request starts to write what its drafts say, the shadows' hits bring its drafts back into
    verification after a few tokens (a probe would have waited PROBE_AFTER steps)."""
    planner = DraftPlanner(4, FixedCost(0.015), drafter_runs_forward=False, max_rows=64, shadow_drafts=True)
    hopeless(planner, "a")
    text = list(range(100, 200))
    for step, tok in enumerate(text):
        ask = planner.ask(["a"], [4], 1)
        drafts = [text[step : step + ask[0]]]
        if planner.choose(["a"], drafts, None, 1, 0.0)[0]:
            break
        planner.committed("a", [tok])
    # (the idle planner plans every few steps: IDLE_SKIP_MAX at most between its plans)
    assert step < PROBE_AFTER // 2 + IDLE_SKIP_MAX


def test_the_ask_drafts_for_requests_without_a_shadow_only():
    """A cheap drafter drafts for every skipped request that has no drafts under judgement (even where drafting
    does not pay), and not for one that has."""
    planner = DraftPlanner(4, FixedCost(0.9), drafter_runs_forward=False, max_rows=64, shadow_drafts=True)
    hopeless(planner, "ab")
    assert planner.ask(["a", "b"], [4, 4], 2) == [4, 4]
    planner.choose(["a", "b"], [[1, 2, 3, 4], []], None, 2, 0.0)
    # (every step planned here: the idle planner's skipped steps are tested on their own)
    planner.skip_left = 0
    assert planner.ask(["a", "b"], [4, 4], 2) == [0, 4]
    planner.committed("a", [7])
    planner.skip_left = 0
    assert planner.ask(["a", "b"], [4, 4], 2) == [4, 4]
    # a request that is removed forgets its shadow
    planner.choose(["a", "b"], [[1, 2, 3, 4], []], None, 2, 0.0)
    planner.remove("a")
    assert "a" not in planner.shadows


# the suite's planner fixture makes drafting free; this test times it
@pytest.mark.row_cost(None)
def test_shadow_drafts_spend_at_most_their_budget_and_take_turns():
    """Drafting for shadows costs the drafter's time: over many steps it stays within SHADOW_BUDGET of the steps'
    cost (plus the rounds before the drafting time is measured), and the skipped requests take turns."""
    cost = FixedCost(0.9)
    ids = [f"r{i}" for i in range(16)]
    planner = DraftPlanner(4, cost, drafter_runs_forward=False, max_rows=64, shadow_drafts=True)
    hopeless(planner, ids)
    per_request = 0.05
    spent = total = 0.0
    turns = dict.fromkeys(ids, 0)
    for _ in range(400):
        ask = planner.ask(ids, [4] * 16, 16)
        seconds = per_request * sum(1 for k in ask if k)
        planner.observe_draft_time(max(ask), seconds)
        drafts = [[1, 2, 3, 4][:k] for k in ask]
        assert planner.choose(ids, drafts, None, 16, seconds) == [0] * 16
        for rid, d in zip(ids, drafts):
            turns[rid] += bool(d)
            # the request writes something else: its shadow is judged at once
            planner.committed(rid, [99])
        spent += seconds
        total += cost.cost(16)
    assert spent <= SHADOW_BUDGET * total + 3 * 16 * per_request
    # (shadows are drafted on planned steps only: about one step in IDLE_SKIP_MAX + 1 here)
    assert min(turns.values()) >= 10 and max(turns.values()) - min(turns.values()) <= 3


def test_an_idle_planner_plans_every_few_steps():
    """While nothing is verified, the first IDLE_AFTER steps are planned, then planned steps grow apart by one
    step each time, up to IDLE_SKIP_MAX skipped steps; a skipped step asks for no drafts (no shadows either) and
    counts as K = 0. A request new to the planner makes it plan at once, and a verified draft makes it plan every
    step again."""
    planner = DraftPlanner(4, FixedCost(0.9), drafter_runs_forward=False, max_rows=64, shadow_drafts=True)
    hopeless(planner, "ab")
    planned = []
    for _ in range(40):
        ask = planner.ask(["a", "b"], [4, 4], 2)
        planned.append(not planner.skipping)
        if planner.skipping:
            assert ask == [0, 0]
        planner.choose(["a", "b"], [[1, 2, 3, 4][:k] for k in ask], None, 2, 0.0)
        # the requests write something else: shadows are judged at once
        planner.committed("a", [9])
        planner.committed("b", [9])
    gaps = [j - i - 1 for i, j in itertools.pairwise([s for s, p in enumerate(planned) if p])]
    first = IDLE_AFTER - 1
    assert gaps[:first] == [0] * first and gaps[first : first + 5] == [1, 2, 3, 4, 4]
    assert set(gaps[first + 5 :]) == {IDLE_SKIP_MAX}
    assert planner.mean_chosen_k == 0.0 and planner.planned_drafts == 80
    # a new request: planned at once
    while not planner.skip_left:
        planner.ask(["a", "b"], [4, 4], 2)
        planner.choose(["a", "b"], [[], []], None, 2, 0.0)
    planner.ask(["a", "b", "c"], [4, 4, 4], 3)
    assert not planner.skipping
    # the engine asks `skips` before `ask`: a new request still ends the stretch, and the ask records it
    while not planner.skip_left:
        planner.ask(["a", "b", "c"], [4, 4, 4], 3)
        planner.choose(["a", "b", "c"], [[], [], []], None, 3, 0.0)
    ids = ["a", "b", "c", "d"]
    assert not planner.skips(ids) and planner.fresh
    planner.ask(ids, [4] * 4, 4)
    assert not planner.skipping and planner.fresh
    assert planner.known.issuperset(ids)
    # a verified draft: every step planned again
    cheap = DraftPlanner(4, FixedCost(0.0), drafter_runs_forward=False, max_rows=64, shadow_drafts=True)
    for _ in range(5):
        ask = cheap.ask(["a"], [4], 1)
        assert not cheap.skipping and cheap.choose(["a"], [[1, 2, 3, 4][: ask[0]]], None, 1, 0.0) == [4]
    # planners that probe skip planning too, and their skipped steps count towards the probes
    probing = DraftPlanner(4, FixedCost(0.015), drafter_runs_forward=True, max_rows=64)
    hopeless(probing, "a")
    skipped, probes = 0, []
    for step in range(6 * PROBE_AFTER):
        if probing.skips(["a"]):
            skipped += 1
            continue
        ask = probing.ask(["a"], [4], 1)
        if probing.choose(["a"], [[1, 2, 3, 4][: ask[0]]], None, 1, 0.0) != [0]:
            probes.append(step)
    assert skipped > 2 * PROBE_AFTER
    gaps = [j - i for i, j in itertools.pairwise(probes)]
    assert len(probes) >= 4 and max(gaps) <= PROBE_AFTER + IDLE_SKIP_MAX + 1


def test_drafts_with_a_distribution_are_not_shadowed():
    """Drafts sampled from a draft distribution are accepted with min(1, p / q), not as often as the target's
    next token equals them: the planner probes for them as before."""
    planner = DraftPlanner(4, FixedCost(0.015), drafter_runs_forward=False, max_rows=64, shadow_drafts=True)
    hopeless(planner, "a")
    chosen = [
        planner.choose(["a"], [[1, 2, 3, 4]], None, 1, 0.0, one_hot=False)[0] for _ in range(PROBE_AFTER + 1)
    ]
    assert chosen[PROBE_AFTER] == 1 and not planner.shadows


def test_node_gains_are_calibrated_path_products_in_prefix_order():
    model = AcceptanceModel(num_positions=3)
    # nodes by path confidence: root -> 1 -> 2, root -> 3 -> 4
    parents, depths = [-1, 0, 1, 0, 3], [0, 1, 2, 1, 2]
    conf = [0.85, 0.55, 0.15, 0.95]
    # uncalibrated bins: each node's estimate is its bin's centre
    assert model.node_gains(parents, depths, conf) == pytest.approx([0.85, 0.85 * 0.55, 0.15, 0.15 * 0.95])
    # a node more confident than one before it is capped by it: a prefix of the nodes is what a step keeps
    assert model.node_gains([-1, 0, 0, 1], [0, 1, 1, 2], [0.85, 0.15, 0.55]) == pytest.approx(
        [0.85, 0.15, 0.15]
    )


def test_tree_outcomes_calibrate_the_judged_nodes_only():
    model = AcceptanceModel(num_positions=3)
    parents, depths = [-1, 0, 0, 1], [0, 1, 1, 2]
    for _ in range(300):
        # node 1 (stated 0.55) accepted, its sibling 2 (0.55) rejected, node 3 (0.55, under 1) rejected
        model.observe_tree(parents, depths, [0.55, 0.55, 0.55], [True, True, False, False])
    # depth 1: half accepted, half not; depth 2: never
    assert model.node_gains([-1, 0], [0, 1], [0.55])[0] == pytest.approx(0.5, abs=0.02)
    assert model.node_gains([-1, 0, 1], [0, 1, 2], [0.55, 0.55])[1] < 0.03
    # nodes under a rejected one were not judged: depth 2 under node 2 teaches nothing
    fresh = AcceptanceModel(num_positions=3)
    fresh.observe_tree(parents[:3] + [2], depths, [0.55] * 3, [True, True, False, False])
    assert fresh.node_gains([-1, 0, 1], [0, 1, 2], [0.55, 0.55])[1] == pytest.approx(
        fresh.node_gains([-1, 0], [0, 1], [0.55])[0] * 0.55
    )


def test_node_budget_takes_the_nodes_that_pay():
    planner = DraftPlanner(3, FixedCost(0.3), drafter_runs_forward=True, max_rows=64)
    parents, depths = [[-1, 0, 0, 1, 1]], [[0, 1, 1, 2, 2]]
    # a node pays when its path probability beats a row's 30% of a step (against a rate of 1 token per step)
    assert planner.choose_nodes(["a"], parents, depths, [[0.95, 0.55, 0.95, 0.05]], 1, 0.0) == 3
    assert planner.choose_nodes(["a"], parents, depths, [[0.05, 0.05, 0.05, 0.05]], 1, 0.0) == 0
    # tokens worth half of a plain step's: only the node of path probability 0.95 still pays
    assert planner.choose_nodes(["a"], parents, depths, [[0.95, 0.55, 0.95, 0.05]], 1, 0.0, worth=[0.5]) == 1


def test_an_unexplored_position_borrows_the_estimate_before_it():
    """Drafts verified up to position 2 only, all accepted: positions 3-4, never judged, start from position 2's
    estimate instead of the fixed prior, so the planner tries them."""
    model = AcceptanceModel(num_positions=4)
    for i in range(50):
        model.observe(f"r{i}", 2, 2)
    c = model.conditional("new", 4)
    assert c[0] > 0.9 and c[1] > 0.9
    assert c[2] == pytest.approx(c[1], abs=0.02) and c[3] == pytest.approx(c[1], abs=0.02)
    # once judged, a position's own record wins
    for i in range(50):
        model.observe(f"s{i}", 3, 2)
    assert model.conditional("new", 4)[2] < 0.3


def test_with_the_engine_speedup_a_good_step_takes_more_drafts():
    """A draft pays when it adds tokens faster than the engine commits them on average: a step with good drafts
    goes further than its own best ratio when other steps (with none) pull the average down; a speedup under 1
    counts as plain decoding's."""
    gains = [expected_gains([0.8] * 8)]

    def cost(rows: int) -> float:
        return 1.0 + 0.25 * (rows - 1)

    # its own best ratio: 3 drafts (2.95 tokens / 1.75)
    assert plan_lengths(gains, cost) == [3]
    # marginal gains above 1.2 * 0.25: the first 5
    assert plan_lengths(gains, cost, speedup=1.2) == [5]
    # plain decoding's rate: gains above 0.25
    assert plan_lengths(gains, cost, speedup=0.5) == plan_lengths(gains, cost, speedup=1.0) == [6]


def test_the_planner_speedup_is_relative_to_plain_steps_of_the_same_batch():
    planner = DraftPlanner(4, FixedCost(0.25), drafter_runs_forward=False, max_rows=64)
    cost = planner._cost(1)
    for _ in range(7):
        planner.observe_step(1, 1, 0, 1)
    # too few steps yet
    assert planner.speedup() is None
    planner.observe_step(1, 1, 0, 1)
    assert planner.speedup() == pytest.approx(1.0)
    # plain steps of a batch of 8 run at plain speed too
    for _ in range(300):
        planner.observe_step(8, 8, 0, 8)
    assert planner.speedup() == pytest.approx(1.0)
    # batch-1 steps committing 3 tokens over 3 rows
    for _ in range(300):
        planner.observe_step(3, 3, 2, 1)
    assert planner.speedup() == pytest.approx(3 * cost(1) / cost(3), rel=0.01)


def test_a_closed_batch_values_a_token_by_the_step_it_frees():
    """Tokens left per request -> what a token committed now saves, in tokens of the plain step now (capped at 1)."""
    cost = linear_cost(2.0, 0.5)
    # a lockstep batch: every token ends the batch a step sooner, as in an open batch
    assert closed_batch_worth([96] * 4, cost) == [1.0] * 4
    # a request ahead of the others frees one row (0.5 s) of a later step; plain seconds per token now: 4 / 4
    assert closed_batch_worth([90, 96, 96, 93], cost) == [0.5, 1.0, 1.0, 0.5]
    # two requests ending together share the saving of their two rows
    assert closed_batch_worth([90, 90, 96], cost) == pytest.approx([0.5 / (3.5 / 3)] * 2 + [1.0])
    # the request the batch waits for would save a whole step (2.5 s), but is capped at 1
    assert closed_batch_worth([90, 91, 92, 96], cost) == [0.5, 0.5, 0.5, 1.0]
    assert closed_batch_worth([7], cost) == [1.0]
    assert closed_batch_worth([], cost) == []


def test_in_a_closed_batch_a_request_ahead_drafts_only_where_a_row_is_nearly_free():
    """The same drafts at the same row price: verified for every request of an open batch; in a closed batch the
    request ahead of the others gets none (its token only frees a row of a later step), the request the batch
    waits for keeps its drafts."""
    planner = DraftPlanner(4, FixedCost(0.05), drafter_runs_forward=False, max_rows=64)
    for _ in range(40):
        planner.observe("a", 4, 3)
        planner.observe("b", 4, 3)
    drafts = [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert planner.choose(["a", "b"], drafts, None, 2, 0.0) == [3, 3]
    worth = planner.token_worth([10, 40])
    assert worth[0] < 0.1 and worth[1] == 1.0
    assert planner.choose(["a", "b"], drafts, None, 2, 0.0, worth=worth) == [0, 3]
    # the ask drafts for the request the batch waits for only
    assert planner.ask(["a", "b"], [4, 4], 2, worth=worth) == [0, 4]
    # requests that may end early: the worth is weighed by the chance that the batch runs as long as it says
    half = planner.token_worth([10, 40], runs=0.5)
    assert half == pytest.approx([1 - 0.5 * (1 - worth[0]), 1.0])
    assert planner.token_worth([10, 40], runs=0.0) == [1.0, 1.0]


def test_an_ended_request_saves_its_own_keys_and_values_too():
    """A batch step reads every sequence's own keys and values, which one sequence's rows profile leaves out: with
    the batch step timed (each sequence 0.3 s beyond its row), a request ahead of the others saves its row and that,
    and its tokens are worth more than the row alone says."""
    rows_only = DraftPlanner(4, FixedCost(0.05), drafter_runs_forward=False, max_rows=64)
    profile = {1: 1.0, 64: 1.0 + 63 * 0.05}
    batch = DraftPlanner(
        4, StepCostModel(profile, batch=(4, 1.15 + 3 * 0.3)), drafter_runs_forward=False, max_rows=64
    )
    assert batch.step_cost.seq_extra == pytest.approx(0.3)
    left = [10, 40, 40, 40]
    # a row: 0.05 s of a 1.15 s step; with its keys and values: 0.35 s of a 2.05 s step
    assert rows_only.token_worth(left)[0] == pytest.approx(0.05 / (1.15 / 4))
    assert batch.token_worth(left)[0] == pytest.approx(0.35 / (2.05 / 4))
    assert batch.token_worth(left)[1:] == [1.0] * 3


def test_the_chance_to_run_learns_the_early_end_rate():
    """A constant per-token rate of early ends, from one per EARLY_END_PRIOR_TOKENS tokens towards what was seen."""
    assert chance_to_run(0, 0, 0) == 1.0
    prior = chance_to_run(100, 0, 0)
    assert prior == pytest.approx((1 - 1 / EARLY_END_PRIOR_TOKENS) ** 100)
    # tokens committed without an early end: running on becomes likelier
    assert prior < chance_to_run(100, 0, 2000) < chance_to_run(100, 0, 20000) < 1.0
    # requests that ended at EOS every 50 tokens: a batch 100 tokens from its limit will hardly run that long
    assert chance_to_run(100, 40, 2000) < 0.2
    assert chance_to_run(200, 0, 2000) < chance_to_run(100, 0, 2000)


def test_the_ask_estimate_learns_from_drafts_with_confidence():
    """A proposer that states its confidence (suffix decoding) whose drafts turn out right: a new request's
    estimate before its drafts exist (no confidence: what the ask reads) follows them, not the prior."""
    model = AcceptanceModel(num_positions=4)
    assert model.conditional("new", 1) == [pytest.approx(0.6)]
    for i in range(60):
        model.observe(f"r{i % 8}", 3, 3, [0.5, 0.5, 0.5])
    assert model.conditional("new", 3)[0] > 0.9
    for i in range(200):
        model.observe(f"r{i % 8}", 3, 0, [0.9, 0.9, 0.9])
    assert model.conditional("new", 1)[0] < 0.2


def test_a_request_whose_confident_drafts_pay_is_asked_above_its_position_rate():
    """Half the requests' first drafts fail (suffix drafts at the start of an answer, the same template tail before
    every one); one request's confident drafts keep being accepted (an answer recalled mid-way). Its estimate with
    confidence stays what its confidence says; its estimate before drafts exist (the ask's) rises well above the
    position's rate."""
    model = AcceptanceModel(num_positions=4)
    for i in range(200):
        model.observe(f"start{i % 8}", 2, i % 2, [0.3, 0.3])
    for _ in range(6):
        model.observe("recall", 2, 2, [0.95, 0.95])
    position_rate = model.conditional("fresh", 1)[0]
    assert 0.4 < position_rate < 0.6
    assert model.conditional("recall", 1)[0] > 1.3 * position_rate
    assert model.conditional("recall", 1, [0.95])[0] == pytest.approx(model._base(0, 0.95), rel=0.1)


def test_a_first_draft_after_an_accepted_one_is_estimated_by_the_streak():
    """Drafts with confidence that come in streaks (recalled answers: the first drafts at an answer's start fail
    until the recall locks on, then they pass): a request's first-draft estimate before its drafts exist follows its
    last judged outcome. Drafts without confidence (n-gram matches) keep their position's rate."""
    model = AcceptanceModel(num_positions=4)
    for i in range(60):
        rid = f"r{i % 8}"
        for hit in [False] * 3 + [True] * 5:
            model.observe_one(rid, 0, hit, 0.5)
    model.observe_one("hit", 0, True, 0.5)
    model.observe_one("miss", 0, False, 0.5)
    after_hit, after_miss = model.conditional("hit", 1)[0], model.conditional("miss", 1)[0]
    assert after_hit > 0.7 and after_miss < 0.45 and after_hit > 1.5 * after_miss
    plain = AcceptanceModel(num_positions=4)
    for i in range(100):
        plain.observe_one(f"r{i % 8}", 0, i % 4 != 0)
    plain.observe_one("hit", 0, True)
    plain.observe_one("miss", 0, False)
    assert plain.requests["hit"].last_hit is None


def _verified(planner: DraftPlanner, rid: str, drafts: list[int], tokens: list[int]) -> None:
    """One decode step of one request: its drafts verified, `tokens` committed (the accepted drafts, then one)."""
    accepted = len(tokens) - 1
    planner.observe_verified(
        [rid],
        SpecDecodeMetadata([drafts]),
        None,
        StepTokens([tokens], [accepted], None, 5),
        1 + len(drafts),
        0.1,
        4,
    )


def test_hindsight_judges_the_depth_the_newest_token_reached():
    """A drafter with a forward reads each newest token again at its catch-up: its pick there is the draft it would
    have made at the depth the last step reached with every verified draft accepted. A request whose second draft
    was rejected early and that has verified one draft a step since learns its second position from those picks
    (without them the estimate would stay where the rejections put it); a pick for an older step's token, or after
    a rejection, teaches nothing."""
    planner = DraftPlanner(4, FixedCost(0.01), drafter_runs_forward=True, max_rows=64)
    for _ in range(3):
        _verified(planner, "a", [1, 2], [1, 9])
    low = planner.acceptance.conditional("a", 2)[1]
    for _ in range(20):
        _verified(planner, "a", [1], [1, 2])
        planner.hindsight(["a"], [(2, None)])
    assert planner.acceptance.conditional("a", 2)[1] > low + 0.3
    # a pick after a rejection (its newest token is the target's correction), which is also a step late for the
    # step before: ignored (a twin planner that gets the same steps without it ends with the same estimates)
    twin = DraftPlanner(4, FixedCost(0.01), drafter_runs_forward=True, max_rows=64)
    for p, picks in ((planner, True), (twin, False)):
        p.acceptance = copy.deepcopy(planner.acceptance)
        _verified(p, "a", [1], [1, 2])
        _verified(p, "a", [1], [7])
        if picks:
            p.hindsight(["a"], [(5, None)])
    high = twin.acceptance.conditional("a", 2)[1]
    assert planner.acceptance.conditional("a", 2)[1] == pytest.approx(high)
    # a wrong pick at the depth reached lowers it
    for p in (planner, twin):
        _verified(p, "a", [1], [1, 2])
    planner.hindsight(["a"], [(5, None)])
    assert planner.acceptance.conditional("a", 2)[1] < twin.acceptance.conditional("a", 2)[1] - 0.05


# the drafting time measured, not patched out
@pytest.mark.row_cost(None)
def test_a_length_measured_in_a_slow_spell_does_not_look_dear_for_good():
    """Each draft length's time is learned only when it is asked for: one measured during a stall of the machine
    must not price that length out forever. The other lengths bound it: a longer draft costs no less, and drafting
    costs at most in proportion to its length."""
    planner = DraftPlanner(4, FixedCost(0.0), drafter_runs_forward=True, max_rows=64)
    # (a request's first ask is left out: test_drafting_time_of_a_requests_first_step_is_not_its_cost)
    planner.ask(["a"], [4], 1)
    planner.observe_draft_time(4, 100.0)
    planner.ask(["a"], [4], 1)
    planner.observe_draft_time(4, 0.1)
    planner.ask(["a"], [4], 1)
    # a stall: 1 s for four drafts
    planner.observe_draft_time(4, 1.0)
    assert planner.draft_cost(4) == pytest.approx(0.28)
    planner.ask(["a"], [4], 1)
    planner.observe_draft_time(1, 0.02)
    # four drafts at most four times one's 20 ms
    assert planner.draft_cost(4) == pytest.approx(0.08)
    # two: in proportion to one, and never above four's
    assert planner.draft_cost(2) == pytest.approx(0.04)
    planner.ask(["a"], [4], 1)
    planner.observe_draft_time(2, 0.5)
    assert planner.draft_cost(2) == pytest.approx(0.04)
    # one measured dear in a stall: bounded by two's and four's times
    planner.ask(["a"], [4], 1)
    planner.observe_draft_time(1, 5.0)
    assert planner.draft_cost(1) <= planner.draft_cost(2) <= planner.draft_cost(4)
