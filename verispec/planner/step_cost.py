"""What one decode step costs as a function of the rows it scores, on this device and kernel build.

A short start-up profile times the target's forward at a few row counts (1 .. K + 1, a full batch plus its drafts,
both sides of the kernels' 16-row tile edges and a doubling ladder up to the largest step the engine may run)
behind a realistic context; the result is cached per model, device, kernel build and thread count. The engine then
refines it online from its own step timings: a scale and a per-step overhead fitted to the measured steps (which
add sampling, Python and context growth to the forward), and the fixed cost of a step that verifies drafts.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch

from verispec.kernels.build import cache_dir
from verispec.runner.model_runner import ModelRunner, RowInput

# per-step decay of the online fit's weights (a memory of about 200 steps)
_DECAY = 0.995
# the fixed cost of verifying is fitted while both kinds of step (with and without drafts) have this much weight
_MIN_GROUP = 2.0
# the fixed cost of verifying counts as if this many more steps with drafts had shown none: a fit from a few noisy
# steps is taken in part, so that a slow moment cannot price verifying out for good (nothing verified, nothing
# measured)
_V_PRIOR_STEPS = 4.0
_PROFILE_CONTEXT = 256
_PROFILE_REPEATS = 6
# the cached profile's spot check runs behind this many tokens: a one-row step reads the weights far more than the
# context, so the check stays comparable while its prefill stays cheap
_CHECK_CONTEXT = 16
# after the first round, no more rounds once this much time has gone (a slow or busy machine)
_PROFILE_BUDGET_S = 1.5
_MAX_PROFILE_ROWS = 256
# bumped when the way a profile is measured or smoothed changes: older cached profiles are not read
_FORMAT = 5


class StepCostModel:
    """Seconds of one target step over `rows` scored rows: a * profile(rows) + b, plus v when the step verifies
    drafts (fitted to relative errors: `observe`).

    profile is the start-up timing of the forward alone (non-decreasing in rows). a, b and v are fitted online, by
    least squares with decaying weights, to the engine's measured steps (which add sampling, Python and context
    growth to the forward): a is the drift of the forward itself, b the per-step overhead that makes an extra row
    relatively cheaper, v what a step pays for verifying at all, whatever its rows (the attention mask over rows of
    unequal length, the verification's own tensors). Until the steps seen span different row counts, a keeps its last
    fitted value (1 at first) and b takes what the measured steps add to it: a full batch that seldom verifies pays
    for attention over every request's own context and for sampling every step, which the one-sequence profile does
    not time and which an extra row does not grow (as a scale it would price every extra row too high). Steps faster
    than a * profile give a = measured / profiled and b = 0. Until both kinds of step (with and without drafts) have
    been seen, v keeps its last fit (0 at first); v is that fit shrunk by the decayed count n of steps with drafts,
    n / (n + _V_PRIOR_STEPS).
    """

    def __init__(self, profile: dict[int, float], batch: tuple[int, float] | None = None):
        """profile: {rows: seconds} of one sequence's forward. batch: (n, seconds) of a plain step over n sequences
        of one row each (`profile_batch_step`), or None."""
        if not profile or min(profile) < 1 or min(profile.values()) <= 0:
            raise ValueError(f"a step-cost profile needs positive timings at row counts >= 1, got {profile}")
        self.rows = sorted(profile)
        self.seconds = [profile[r] for r in self.rows]
        self.a, self.b, self.v = 1.0, 0.0, 0.0
        # v as fitted, before the prior of _V_PRIOR_STEPS
        self._v_fit = 0.0
        # profiled(rows) by rows: the planner asks for the same few row counts every step
        self._memo: dict[int, float] = {}
        # profiled(r) for r = 0, 1, ... as far as a table was asked for
        self._profiled: list[float] = []
        # what each sequence after the first adds to a plain step beyond its row (its own keys and values read by
        # attention, its own sampling): 0 without a batch timing
        self.seq_extra = 0.0
        if batch is not None and batch[0] > 1:
            n, seconds = batch
            self.seq_extra = max(0.0, (seconds - self.profiled(n)) / (n - 1))
        # per kind of step (without drafts, with), decayed sums of: steps, then, each step weighted, its weight,
        # x = profile(rows), y = seconds, x^2, x*y
        self._sums = [[0.0] * 6, [0.0] * 6]

    def profiled(self, rows: int) -> float:
        """The start-up profile, linear between its points and beyond its ends."""
        out = self._memo.get(rows)
        if out is None:
            xs, ys = self.rows, self.seconds
            if len(xs) == 1:
                out = ys[0] * rows / xs[0]
            else:
                i = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)
                x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                out = max(ys[0], y0 + (y1 - y0) * (rows - x0) / (x1 - x0))
            self._memo[rows] = out
        return out

    def cost(self, rows: int, drafted: bool = False) -> float:
        """drafted: the step verifies drafts (it pays v too)."""
        return self.a * self.profiled(rows) + self.b + (self.v if drafted else 0.0)

    def plain_batch(self, n: int) -> float:
        """Seconds of a plain step over n sequences (one row each): what a closed batch saves per step once a
        request has ended is the difference of two of these (its row and its own keys and values)."""
        return self.a * (self.profiled(n) + max(0, n - 1) * self.seq_extra) + self.b

    def table(self, plain_rows: int, most_rows: int) -> list[float]:
        """cost(r, drafted=r > plain_rows) for r = 0 .. most_rows in one pass: the planner weighs every row count
        of a step, every step."""
        p = self._profiled
        if len(p) <= most_rows:
            p.extend(self.profiled(r) for r in range(len(p), most_rows + 1))
        a, b, v = self.a, self.b, self.v
        cut = min(plain_rows, most_rows) + 1
        return [a * x + b for x in p[:cut]] + [a * x + b + v for x in p[cut : most_rows + 1]]

    def observe(self, rows: int, seconds: float, drafted: bool = False) -> None:
        """One measured step over `rows` rows; drafted: it verified drafts.

        Each step weighs 1 / profile(rows)^2 in the fit (its relative error is what counts): a VM's timing noise
        scales with the step, and a few steps of hundreds of rows (long drafts for a whole batch) would otherwise
        outweigh the many steps near the batch size, where the planner decides."""
        x = self.profiled(rows)
        w = (self.seconds[0] / x) ** 2
        for sums in self._sums:
            for i in range(6):
                sums[i] *= _DECAY
        kind = self._sums[int(drafted)]
        for i, d in enumerate((1.0, w, w * x, w * seconds, w * x * x, w * x * seconds)):
            kind[i] += d
        if min(self._sums[0][0], self._sums[1][0]) >= _MIN_GROUP:
            self._fit_both()
        else:
            self._fit_one()
        n = self._sums[1][0]
        self.v = self._v_fit * n / (n + _V_PRIOR_STEPS)

    def _fit_both(self) -> None:
        """Both kinds of step seen: one slope a, an intercept per kind (b, and b + v)."""
        (_, w0, x0, y0, xx0, xy0), (_, w1, x1, y1, xx1, xy1) = self._sums
        # x's variance and covariance with y within each kind, pooled
        var = xx0 - x0 * x0 / w0 + xx1 - x1 * x1 / w1
        cov = xy0 - x0 * y0 / w0 + xy1 - x1 * y1 / w1
        mean_x = (x0 + x1) / (w0 + w1)
        if var / (w0 + w1) > (0.05 * mean_x) ** 2:
            a = cov / var
            b = y0 / w0 - a * x0 / w0
            v = y1 / w1 - a * x1 / w1 - b
            if a > 0 and b >= 0 and v >= 0:
                self.a, self.b, self._v_fit = a, b, v
                return
        # rows barely vary within a kind (a full batch that seldom verifies): the plain steps' overhead over a
        self._offset(w0, x0, y0)
        self._v_fit = max(0.0, (y1 - self.a * x1 - self.b * w1) / w1)

    def _fit_one(self) -> None:
        """One kind of step only: v as last fitted, a and b from the steps with v taken out."""
        (_, w0, x0, y0, xx0, xy0), (_, w1, x1, y1, xx1, xy1) = self._sums
        w, sx, sxx = w0 + w1, x0 + x1, xx0 + xx1
        sy, sxy = y0 + y1 - self._v_fit * w1, xy0 + xy1 - self._v_fit * x1
        var = sxx / w - (sx / w) ** 2
        if var > (0.05 * sx / w) ** 2:
            a = (sxy / w - sx / w * sy / w) / var
            b = sy / w - a * sx / w
            if a > 0 and b >= 0:
                self.a, self.b = a, b
                return
        self._offset(w, sx, sy)

    def _offset(self, w: float, sx: float, sy: float) -> None:
        """Steps of one row count (weight w, sums of profile sx and seconds sy): the per-step overhead b over the last
        fitted a, or a smaller a and b = 0 when the steps run faster than a * profile."""
        if sy >= self.a * sx:
            self.b = (sy - self.a * sx) / w
        else:
            self.a, self.b = sy / sx, 0.0


# the row tile of the kernels (AMX-INT8's 16 rows; the VNNI and FMA kernels sweep 32): a step's cost jumps where a
# tile fills
_TILE = 16
# tile edges are profiled up to this many rows (further up a jump is small against the step)
_TILE_EDGES_UP_TO = 64


def profile_points(num_speculative_tokens: int, max_rows: int, batch_size: int = 1) -> list[int]:
    """1 .. K + 1; a full batch's plain step and its first K + 1 extra rows (B .. B + K + 1: where the planner
    decides, around a tile edge when B is a multiple of 16); both sides of every 16-row tile edge up to 64 rows
    (a 17th row can cost as much as a whole tile: linear interpolation would miss that); then doubling up to
    max_rows (at most _MAX_PROFILE_ROWS)."""
    top = max(1, min(max_rows, _MAX_PROFILE_ROWS))
    k = num_speculative_tokens
    points = set(range(1, min(k + 1, top) + 1))
    if batch_size > 1:
        points.update(range(batch_size, min(batch_size + k + 1, top) + 1))
    for edge in range(_TILE, min(top, _TILE_EDGES_UP_TO) + 1, _TILE):
        points.update(r for r in (edge, edge + 1) if r <= top)
    r = k + 1
    while r * 2 <= top:
        r *= 2
        points.add(r)
    points.add(top)
    return sorted(points)


def _profile_context(runner: ModelRunner, slot: int, most_rows: int, tokens: int = _PROFILE_CONTEXT) -> int:
    """Prefill a `tokens`-token context (less where the cache is short) into `slot` -> its length."""
    room = runner.cache.t_alloc - most_rows - 2
    context = max(0, min(tokens, room))
    if context:
        runner.run([RowInput(slot, 0, [0] * context, logits_from=context - 1)])
    return context


@torch.inference_mode()
def profile_step_cost(
    runner: ModelRunner,
    slot: int,
    points: list[int],
    repeats: int = _PROFILE_REPEATS,
    context: int = _PROFILE_CONTEXT,
) -> dict[int, float]:
    """Time the target's forward over each row count in `points` (best of a few rounds) on a free KV slot, behind a
    `context`-token context. The slot's cache is scratch: the next request in it overwrites it."""
    with runner.cache.borrowed([slot], runner.cache.t_alloc - 1):
        return _profile_rows(runner, slot, points, repeats, context)


def _profile_rows(
    runner: ModelRunner, slot: int, points: list[int], repeats: int, context: int
) -> dict[int, float]:
    context = _profile_context(runner, slot, max(points), context)
    best = dict.fromkeys(points, float("inf"))
    runner.run([RowInput(slot, context, [0] * max(points))])
    # rounds over the points (not repeats of one point), so a burst of load elsewhere spreads over all of them
    start = time.perf_counter()
    budget = _PROFILE_BUDGET_S
    for i in range(repeats):
        elapsed = time.perf_counter() - start
        if i == 1:
            # a first round that took most of the budget (a large batch's ladder up to 256 rows) would leave every
            # point one timing: its cheap points, where the planner decides, still get their repeats
            budget = max(budget, 2 * elapsed)
        if i and elapsed > budget:
            break
        # after the first round, the points whose step fits an equal share of the budget (not the ladder's dearest),
        # in a different order each round: a stretch where the machine runs slower or faster falls on scattered
        # points, not on a range of row counts (whose slope would then be wrong)
        due = points if i == 0 else [r for r in points if best[r] <= budget / len(points)]
        if i:
            due = random.Random(i).sample(due, len(due))
        for rows in due:
            t = time.perf_counter()
            runner.run([RowInput(slot, context, [0] * rows)])
            sync(runner.device)
            best[rows] = min(best[rows], time.perf_counter() - t)
    return monotone_profile(best)


def batch_profile_slots(cache, most: int) -> list[int]:
    """The slots profile_batch_step runs: up to `most`, as many as the KV pool holds behind its context."""
    per_seq = -(-min(cache.t_alloc - 1, _PROFILE_CONTEXT + 2) // cache.block_size)
    return list(range(min(most, cache.num_slots, cache.pool.num_usable // per_seq)))


@torch.inference_mode()
def profile_batch_step(
    runner: ModelRunner, slots: list[int], repeats: int = _PROFILE_REPEATS
) -> tuple[int, float]:
    """(n, seconds): the best of a few plain steps over n = len(slots) sequences of one row each, every one behind a
    copy of the first slot's _PROFILE_CONTEXT-token context. The rows profile times one sequence: a batch step also
    reads every sequence's own keys and values, which a closed batch saves once a request has ended. The slots are
    scratch."""
    with runner.cache.borrowed(slots[:1], min(runner.cache.t_alloc - 1, _PROFILE_CONTEXT + 2)):
        context = _profile_context(runner, slots[0], 1)
        with runner.cache.borrowed(slots[1:], context + 1):
            runner.cache.copy_prefix(slots[0], slots[1:], context)
            rows = [RowInput(s, context, [0]) for s in slots]
            runner.run(rows)
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                runner.run(rows)
                sync(runner.device)
                best = min(best, time.perf_counter() - t)
    return len(slots), best


def monotone_profile(best: dict[int, float]) -> dict[int, float]:
    """Best timings per row count -> a profile that never gets cheaper with more rows.

    First a point dearer or cheaper than both its neighbours takes the nearer of their times (the median of the
    three): one interrupted timing, or one taken while a shared VM briefly ran fast, is one point's noise, and a
    real step up (a row tile filling) has a point above it on either side and stays. What still decreases is
    pooled with its neighbours into their mean (pool-adjacent-violators: the least-squares non-decreasing fit).
    Taking instead the least time measured at or above each point let one fast stretch pull every point below it
    down to its time, and the planner, which weighs the rows in between, saw verified rows as free."""
    rows = sorted(best)
    times = [best[r] for r in rows]
    smooth = list(times)
    for i in range(1, len(times) - 1):
        smooth[i] = sorted(times[i - 1 : i + 2])[1]
    # (sum, count) blocks, each block's mean above the previous one's
    blocks: list[tuple[float, int]] = []
    for t in smooth:
        total, n = t, 1
        while blocks and blocks[-1][0] / blocks[-1][1] > total / n:
            prev_total, prev_n = blocks.pop()
            total, n = total + prev_total, n + prev_n
        blocks.append((total, n))
    fitted = [total / n for total, n in blocks for _ in range(n)]
    return dict(zip(rows, fitted))


def load_or_profile(
    runner: ModelRunner, slot: int, points: list[int], key_parts: tuple, batch_slots: list[int] | None = None
) -> tuple[StepCostModel, bool]:
    """The cached profile for this model / device / kernel build / thread count when a spot check of its smallest
    step (behind a short context: its prefill would cost more than the check, seconds on a 1.5B model) still agrees
    with it within 2x, else a fresh one (then cached). batch_slots: free slots
    (two or more) for a batch step (`profile_batch_step`). -> (model, whether it came from the cache)."""
    batch_slots = batch_slots if batch_slots and len(batch_slots) > 1 else None
    ident = repr((_FORMAT, key_parts, points, torch.get_num_threads(), len(batch_slots or ())))
    key = hashlib.sha256(ident.encode()).hexdigest()[:24]
    path = _cache_dir() / f"{key}.json"
    try:
        saved = json.loads(path.read_text())
        cached = {int(r): float(s) for r, s in saved["rows"].items()}
        batch = None if saved["batch"] is None else (int(saved["batch"][0]), float(saved["batch"][1]))
        model = StepCostModel(cached, batch)
        check = profile_step_cost(runner, slot, [points[0]], repeats=2, context=_CHECK_CONTEXT)
        if all(0.5 <= check[r] / model.profiled(r) <= 2.0 for r in check):
            return model, True
    except (OSError, ValueError, AttributeError, TypeError, KeyError, IndexError):
        pass
    profile = profile_step_cost(runner, slot, points)
    batch = None if batch_slots is None else profile_batch_step(runner, batch_slots)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"rows": profile, "batch": batch}))
        os.replace(tmp, path)
    except OSError:
        pass
    return StepCostModel(profile, batch), False


def model_fingerprint(path: str | Path) -> tuple:
    """What identifies a model's weights cheaply: its resolved path, size and modification time."""
    p = Path(path)
    try:
        files = [p] if p.is_file() else sorted(p.glob("*.safetensors")) + sorted(p.glob("*.gguf"))
        return (str(p.resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    except OSError:
        return (str(p),)


def _cache_dir() -> Path:
    # beside the compiled kernels, under VERISPEC_CACHE (or ~/.cache/verispec)

    return cache_dir().parent / "step_cost"


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host clock read next times it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
