"""Goodput planner: how many drafts each request verifies this step.

Verifying a draft costs a target row; it pays only if the draft is likely to be accepted and the extra row is cheap
on the hardware at hand. Every step the planner picks per-request draft lengths that maximise expected committed
tokens per second for the whole batch:

    maximise  (B + sum_b sum_{i <= k_b} P(drafts 1..i of b accepted)) / (C(B + sum_b k_b) + D)

with C the measured cost of a target step over that many rows (planner/step_cost.py) and D the drafting cost. The
probabilities of a request's drafts decrease with depth, so the best allocation of n extra rows takes the n largest
probabilities over the batch; the planner scans n and keeps the best ratio (exact for this objective).

`AcceptanceModel` (planner/acceptance.py) estimates the conditional acceptance P(draft i accepted | drafts before it accepted) online: a
base rate per draft position (or per draft position and confidence bin when the proposer says how sure it is, as
suffix decoding does), learned across requests, times a per-request factor from the request's own recent history.

Everything here is plain Python on host numbers: no tensors, no model, tested on its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter

from verispec.planner.acceptance import AcceptanceModel, expected_gains
from verispec.sample.metadata import SpecDecodeMetadata, StepTokens


def plan_lengths(
    gains: Sequence[Sequence[float]],
    step_cost: Callable[[int], float],
    draft_cost: Callable[[int], float] = lambda k: 0.0,
    max_rows: int | None = None,
    base_rows: int | None = None,
    discount: float = 1.0,
    speedup: float | None = None,
) -> list[int]:
    """Per-request draft lengths maximising expected tokens per second.

    gains[b][i]: expected extra tokens of request b's (i+1)-th draft (non-increasing in i: `expected_gains`);
    len(gains[b]) is its cap. step_cost(rows): seconds of one target step scoring that many rows (B rows for a
    plain step). draft_cost(k): seconds of drafting when the longest draft is k (0 for k = 0). max_rows: most rows
    the step may score. base_rows: the step's rows without drafts (default B; more when requests that do not
    speculate share the step). discount: the share of the expected gains counted. Returns k_b in
    [0, len(gains[b])]; all zero when speculating does not pay.

    speedup: the engine's recent tokens per second relative to plain decoding's (DraftPlanner.speedup). Without
    it the step's own tokens per second is maximised. With it, tokens - R * seconds is, R being this step's plain
    rate times the speedup (the long-run rate's criterion: a draft is worth its extra seconds when it adds tokens
    faster than the engine commits them on average, so a step with good drafts takes more of them than its own
    ratio would when other steps have none). A speedup under 1 counts as 1: plain decoding is always within reach.

    step_cost must not decrease with rows and draft_cost must not be negative: the scan stops once the gains left
    could not beat the best so far even at the next row count's step cost (most steps stop after a few rows).
    """
    b = len(gains)
    base = b if base_rows is None else base_rows
    room = sum(len(g) for g in gains)
    if max_rows is not None:
        room = min(room, max(0, max_rows - base))
    plain = step_cost(base) + draft_cost(0)
    r = None if speedup is None else max(speedup, 1.0) * base / plain
    # every (gain, request) in the order the greedy allocation takes them; ties keep shallower drafts first
    pairs = [(g, i) for i, row in enumerate(gains) for g in row]
    order = sorted(pairs, key=itemgetter(0), reverse=True)[:room]
    # tokens per second, or tokens - r * seconds
    best_n, best = 0, base / plain if r is None else base - r * plain
    tokens, longest, taken = float(base), 0, [0] * b
    # the discounted gains not yet taken
    left = discount * sum(g for g, _ in order)
    for n, (g, i) in enumerate(order, start=1):
        # no later n can do better than every gain left at this step's cost without drafting
        floor = step_cost(base + n)
        bound = tokens + left
        if (bound / floor if r is None else bound - r * floor) <= best:
            break
        tokens += g * discount
        left -= g * discount
        depth = taken[i] = taken[i] + 1
        longest = depth if depth > longest else longest
        seconds = floor + draft_cost(longest)
        v = tokens / seconds if r is None else tokens - r * seconds
        if v > best:
            best_n, best = n, v
    lengths = [0] * b
    for _, i in order[:best_n]:
        lengths[i] += 1
    return lengths


def closed_batch_worth(left: Sequence[int], step_cost: Callable[[int], float]) -> list[float]:
    """What a token committed now is worth to each request of a closed batch (no request joins it before it ends),
    in tokens of today's plain step (1: a token's worth where a finished request's slot is refilled at once).

    left[b]: the steps request b still takes (its tokens left where drafts are not accepted; the engine divides
    them by the request's commit rate so far). step_cost(n): seconds of a plain step over n rows. The batch runs
    max(left) more steps, and the step t from now scores the requests with at least t left. A token that request b
    commits early takes its row out of the step where it would have ended; the requests ending there together
    share that step's saving, the whole step when no other request outlives them. So a token of a request ahead of others saves
    only the price of a row, and at a lockstep start (every left equal) every token is worth 1, as in an open
    batch. The worth is capped at 1: the requests the batch waits for are mostly the ones whose drafts fail, so
    their acceptance estimates are the least reliable, and a step-sized worth makes the planner verify their
    unlikely drafts."""
    n = len(left)
    if n == 0:
        return []
    per_token = step_cost(n) / n
    # how many requests end at each count, and how many have at least that many left
    ending = Counter(left)
    at_least, running = {}, 0
    for v in sorted(ending, reverse=True):
        running += ending[v]
        at_least[v] = running

    def saved(v: int) -> float:
        rows, m = at_least[v], ending[v]
        rest = rows - m
        return (step_cost(rows) - (step_cost(rest) if rest else 0.0)) / m

    worth = {v: min(1.0, saved(v) / per_token) for v in ending}
    return [worth[v] for v in left]


# the prior of the early-end rate (EOS or a stop rule): one early end per this many tokens of requests that may end
# early, as if their responses were a few hundred tokens long
EARLY_END_PRIOR_TOKENS = 256


def chance_to_run(tokens: int, early_ends: int, exposure: int) -> float:
    """The probability that requests that may end early (EOS, a stop rule) commit `tokens` more without an early end
    (one request's tokens left, or several requests' together), with early ends seen `early_ends` times over
    `exposure` committed tokens of such requests: a constant per-token rate, its estimate starting from one early
    end per EARLY_END_PRIOR_TOKENS tokens. Batches whose requests run to max_tokens make it approach 1 as they run;
    requests ending at EOS make it fall."""
    rate = min(1.0, (early_ends + 1) / (EARLY_END_PRIOR_TOKENS + exposure))
    return (1.0 - rate) ** max(0, tokens)


def schedule_cap(schedule: Sequence[Sequence[int]] | None, batch_size: int, cap: int) -> int:
    """num_speculative_tokens_per_batch_size as vLLM applies it: the K of the last [start_bs, end_bs, K] range
    starting at or below batch_size (a batch size between two ranges, or past the last one, takes the previous
    range's K), clamped to `cap` (num_speculative_tokens); `cap` without a schedule."""
    k = cap
    for start, _, range_k in sorted(schedule or ()):
        if start > batch_size:
            break
        k = range_k
    return min(k, cap)


# a request whose drafts the planner skipped this many speculating steps in a row verifies one draft (a probe):
# without it a request that once looked hopeless would never show that it has become predictable
PROBE_AFTER = 16
# probes spend at most this share of the target's step time: every step adds that share of its cost to a credit,
# and a due probe runs once the credit covers what its row adds to the step (and, for a drafter with a forward of its
# own, what drafting for one request costs: its catch-up on the tokens since it last drafted, then its draft).
# Where an extra row is cheap (an AMX tile with room, a memory-bound step) a due request probes at once; where a row
# is dear (a 17th row past a full AMX-INT8 tile, rows as costly as a step) due probes wait and then run together, so
# they stay within the budget
PROBE_BUDGET = 0.02
# a cheap drafter's shadow drafts (drafts judged against the tokens committed instead of verified) spend at most
# this share of the target's step time on drafting: skipped requests take turns, longest waiting first
SHADOW_BUDGET = 0.01
# while no draft pays, planning itself is most of what speculation costs an idle step (the ask, shadow drafts, the
# choice): after n >= IDLE_AFTER planned steps in a row that verified
# nothing, the next min(n - IDLE_AFTER + 1, IDLE_SKIP_MAX) steps ask for no drafts, shadows included, without
# planning. A verified draft or a new request ends it. Short idle stretches (between the copied spans of an edit)
# plan every step, so the next span is drafted from its start. Skipped steps count towards a request's probe
# (PROBE_AFTER) and add to the probe credit
IDLE_AFTER = 8
IDLE_SKIP_MAX = 4


# how many draft positions decide whether a cheap drafter drafts at all this step
_ASK_DEPTH = 4
# the share of a draft's expected gain the planner counts: it takes the drafts whose estimates are highest, so
# their estimates are optimistic on average, and a step that only seems to pay loses. Where rows are free any gain
# still pays
GAIN_DISCOUNT = 0.9
# a drafter with a forward of its own reads the positions committed since it last drafted for a request before it
# drafts (EAGLE's catch-up, a draft model's prefill): its seconds per position read are learned from asks that read at
# least this many positions, where reading is most of the time
_READ_FIT_POSITIONS = 32
# a request's reading pays if drafting saves more over its tokens left, counted over at most this many of its
# drafting steps: drafting may stop again (a probe, a short copied span), and the next draft reads the positions
# committed meanwhile
_READ_HORIZON = 64
# the engine's recent speedup (`DraftPlanner.speedup`): per-step decay of its sums (about the last 50 steps), and the
# steps seen before it is used (until then a step maximises its own tokens per second)
_SPEEDUP_DECAY = 0.98
_SPEEDUP_AFTER = 8


@dataclass
class _Shadow:
    """Drafts the planner did not verify, judged against the tokens the request commits next. A one-hot draft token
    is accepted with the target's probability of it, which is also the chance that the target's next token is that
    token: the comparison is an unbiased outcome of verifying it (greedy: the very outcome), at no row's cost."""

    drafts: list[int]
    confidence: list[float] | None
    judged: int = 0


class DraftPlanner:
    """The engine's per-step draft-length decisions: an AcceptanceModel, the target's StepCostModel
    (planner/step_cost.py) and the drafting cost the engine measures, brought together by `plan_lengths`."""

    # the ask reads a drafter's backlog; a closed batch's tokens are weighed by the time they save
    reads_backlog = True
    weighs_worth = True

    def __init__(
        self,
        num_speculative_tokens: int,
        step_cost,
        drafter_runs_forward: bool,
        max_rows: int,
        shadow_drafts: bool = False,
    ):
        """shadow_drafts: a cheap drafter's drafts that the step does not verify are judged against the tokens the
        request commits next (`committed`), which replaces probing: the engine turns it on for drafters without a
        forward of their own, whose drafts are one-hot."""
        self.k = num_speculative_tokens
        self.acceptance = AcceptanceModel(max(1, num_speculative_tokens))
        self.step_cost = step_cost
        self.runs_forward = drafter_runs_forward
        self.max_rows = max_rows
        # drafting seconds by the longest draft asked for (moving averages)
        self.draft_seconds: dict[int, float] = {}
        # what the planner chose, for the mean chosen K
        self.planned_tokens = 0
        self.planned_drafts = 0
        # seconds of step time that probes may still spend (PROBE_BUDGET of every planned step's cost)
        self.probe_credit = 0.0
        # the cost of the last planned step (a skipped step adds its share to the probe credit)
        self.last_step_cost = 0.0
        # requests asked before, and whether this step's ask had a new one: its drafter first catches up on the
        # whole prompt (a draft model's prefill, suffix trees built over it), which is no per-step drafting cost
        self.known: set[str] = set()
        self.fresh = False
        # this step's caps at the ask: a request asked for nothing was skipped (it counts towards its probe)
        self.caps: dict[str, int] = {}
        self.shadow_drafts = shadow_drafts
        # per request, the unverified drafts being judged against its next tokens
        self.shadows: dict[str, _Shadow] = {}
        # per request verifying this step, its first draft past the verified ones (token, confidence): if every
        # verified draft is accepted, the step's bonus token judges it
        self.next_draft: dict[str, tuple[int, float | None]] = {}
        # per request, (depth, step, token): its newest committed token, the draft position that token judges in
        # hindsight (the depth its last decode step reached with every verified draft accepted; 0 after a step
        # without drafts) and that step's number
        self.newest: dict[str, tuple[int, int, int]] = {}
        self.observed_steps = 0
        # drafting seconds per request asked (moving average), requests this step's ask drafted for, and the
        # drafting time that shadow drafts may still spend (SHADOW_BUDGET of every step's cost)
        self.request_draft_seconds = 0.0
        self.asked = 0
        # a drafter with a forward: request_draft_seconds as this step's ask read it (its probes' drafting cost)
        self.probe_drafting = 0.0
        # a drafter with a forward: its seconds per position read to catch up (moving average; the drafting times
        # above are kept net of reading), and what reading each request's backlog would cost at this step's ask
        self.read_seconds = 0.0
        self.reading: dict[str, float] = {}
        # seconds this step's ask spent reading (counted in the recent speedup by observe_step)
        self.read_spent = 0.0
        self.shadow_credit = 0.0
        self.turns = 0
        # planned steps in a row that verified nothing, steps left to skip planning, and whether this step skipped it
        self.idle_plans = 0
        self.skip_left = 0
        self.skipping = False
        # decayed sums of the decode steps' committed tokens per row and seconds per plain step: the recent speedup
        self.step_tokens = 0.0
        self.step_seconds = 0.0
        self.steps_seen = 0

    def draft_cost(self, k: int) -> float:
        """Estimated drafting seconds when the longest draft is k: measured, or scaled from the nearest measured k
        (drafting runs one forward per draft token), 0 before any measurement. Either way at most what the other
        measured lengths bound it by: a longer draft costs no less (so k costs at most any longer one's time), and
        drafting costs at most in proportion to its length (at most j's time x k / j for a shorter j). A length
        measured once in a slow spell of the machine would otherwise look dear, never be asked for again, and keep
        that figure for good."""
        if k == 0 or not self.draft_seconds:
            return 0.0
        if k in self.draft_seconds:
            own = self.draft_seconds[k]
        else:
            near = min(self.draft_seconds, key=lambda j: abs(j - k))
            own = self.draft_seconds[near] * k / near
        bounds = [t if j > k else t * k / j for j, t in self.draft_seconds.items() if j != k]
        return min([own, *bounds])

    def observe_draft_time(self, k: int, seconds: float, read: int | None = None) -> None:
        """The drafting time of this step's ask, whose longest draft was k. read: the positions a drafter with a
        forward of its own read to catch up first (None: not counted). An ask that read at least
        _READ_FIT_POSITIONS teaches the seconds per position read (and only that: reading is most of its time); the
        others teach the drafting times, net of reading. Until reading is priced, a step where some request drafted
        for the first time is left out: its prompt catch-up would make k look dear, and a k that looks dear is
        never asked for again."""
        if k == 0:
            # nothing drafted
            return
        if read is not None and read >= _READ_FIT_POSITIONS:
            self.read_spent = max(0.0, seconds - self.draft_cost(k))
            per = self.read_spent / read
            old = self.read_seconds
            self.read_seconds = per if not old else old + 0.2 * (per - old)
            return
        if read is not None:
            self.read_spent = self.read_seconds * read
        if self.fresh and not (read is not None and self.read_seconds):
            return
        if read is not None:
            seconds = max(0.0, seconds - self.read_spent)
        old = self.draft_seconds.get(k)
        self.draft_seconds[k] = seconds if old is None else old + 0.2 * (seconds - old)
        if self.asked:
            per, old = seconds / self.asked, self.request_draft_seconds
            self.request_draft_seconds = per if not old else old + 0.2 * (per - old)

    def skips(self, request_ids: list[str]) -> bool:
        """Whether this decode step is one of an idle stretch's skipped steps (IDLE_AFTER): no drafts, no planning,
        counted as K = 0. A request new to the planner ends the stretch. `ask` calls it, and the engine before
        that (a skipped step then runs as a plain one, without asking the drafter or the planner): a step that is
        not skipped reads the same twice (`ask` records the requests as known)."""
        self.fresh = not self.known.issuperset(request_ids)
        self.skipping = self.skip_left > 0 and not self.fresh
        if self.skipping:
            self.skip_left -= 1
            self.asked = 0
            self.next_draft.clear()
            self.planned_drafts += len(request_ids)
            if not self.shadow_drafts:
                # a skipped step skips every request: it counts towards their probes, and its time (about the last
                # planned step's) adds to the probe credit
                for rid in request_ids:
                    self.acceptance.history(rid).idle_steps += 1
                self.probe_credit += PROBE_BUDGET * self.last_step_cost
        return self.skipping

    def ask(
        self,
        request_ids: list[str],
        caps: list[int],
        batch_rows: int,
        worth: list[float] | None = None,
        backlog: list[int] | None = None,
        steps_left: list[int] | None = None,
    ) -> list[int]:
        """How many drafts to ask each request's proposer for, planned from the requests' histories (a proposer is
        never asked for drafts the planner will not verify). A drafter with a forward of its own gets exactly the
        planned lengths; a cheap one gets its whole cap wherever some drafting pays, so that its drafts' own
        confidence can refine the choice, and nothing where none does (its drafting time is saved).

        worth: per request, what its tokens are worth to a closed batch (`token_worth`); None in an open one.
        backlog: per request, the positions a drafter with a forward of its own would read before drafting for it
        (priced at the learned seconds per position read; None: not counted). steps_left: per request, the most
        decode steps it has left: reading once serves the drafts after it, so it is weighed against what drafting
        saves over them (`_reading_pays`; a probe pays the whole from its credit)."""
        self.caps = dict(zip(request_ids, caps))
        if self.skips(request_ids):
            return [0] * len(caps)
        self.known.update(request_ids)
        if self.runs_forward:
            # what a probe's drafting and each request's reading cost, for this step's ask and choice alike
            self.probe_drafting = self.request_draft_seconds
            reading = [self.read_seconds * n for n in backlog] if backlog is not None else []
            self.reading = dict(zip(request_ids, reading))
            gains = [self.acceptance.gains(rid, c) for rid, c in zip(request_ids, caps)]
            cost = self._cost(batch_rows, self._most_rows(batch_rows, caps))
            lengths = self._plan(gains, cost, self.draft_cost, batch_rows, worth)
            if backlog is not None:
                left = steps_left or [1] * len(reading)
                pays = self._reading_pays(gains, lengths, reading, left, cost, batch_rows, worth)
                if not all(pays):
                    gains = [g if ok else [] for g, ok in zip(gains, pays)]
                    lengths = self._plan(gains, cost, self.draft_cost, batch_rows, worth)
            out = self._probe(request_ids, lengths, caps, cost, batch_rows + sum(lengths), count=False)
            if not self.draft_seconds and backlog is not None:
                # nothing measured yet: one request (the least to read) drafts first, plan or probe, so that the
                # drafting and reading times are known before the batch pays them (a self-draft's prefill of 16
                # prompts: 0.9 s)
                planned = [i for i, k in enumerate(out) if k]
                if len(planned) > 1:
                    scout = min(planned, key=lambda i: backlog[i])
                    out = [k if i == scout else 0 for i, k in enumerate(out)]
            self.asked = sum(1 for k in out if k)
            return out
        # a cheap drafter's time does not depend on how much it drafts: whether any of its first few drafts would
        # pay decides it
        drafting = self.draft_cost(max(caps, default=0))
        head = [min(c, _ASK_DEPTH) for c in caps]
        gains = [self.acceptance.gains(rid, c) for rid, c in zip(request_ids, head)]
        cost = self._cost(batch_rows, self._most_rows(batch_rows, head))
        lengths = self._plan(gains, cost, lambda k: drafting if k else 0.0, batch_rows, worth)
        if self.shadow_drafts:
            lengths = self._shadow_asks(request_ids, lengths, caps, cost(batch_rows))
        else:
            lengths = self._probe(request_ids, lengths, caps, cost, batch_rows + sum(lengths), count=False)
        out = [cap if k > 0 else 0 for k, cap in zip(lengths, caps)]
        self.asked = sum(1 for k in out if k)
        return out

    def _reading_pays(
        self,
        gains: list[list[float]],
        lengths: list[int],
        reading: list[float],
        left: list[int],
        cost: Callable[[int], float],
        batch_rows: int,
        worth: list[float] | None,
    ) -> list[bool]:
        """Per request, whether its drafter's reading (seconds, once) pays for itself over the tokens it has left:
        drafting as planned without it, a token costs the request's share of the plain step plus what its drafts
        add to the step, over the tokens the step commits for it; the seconds saved per token against plain
        decoding, times its tokens left (at most _READ_HORIZON steps of them: drafting may stop again, and the
        positions committed meanwhile are read again), must exceed the reading. One-time costs are weighed over the
        request and not per step: a step's share of them would make a request that has not yet drafted look
        dearer every step it waits, and it would never start."""
        plain = cost(batch_rows)
        share = plain / max(1, batch_rows)
        out = []
        for b, (g, k, x, n) in enumerate(zip(gains, lengths, reading, left)):
            if x <= 0:
                out.append(True)
                continue
            w = 1.0 if worth is None else worth[b]
            tokens = 1.0 + GAIN_DISCOUNT * w * sum(g[:k])
            extra = cost(batch_rows + k) - plain + self.draft_cost(k)
            saved = share - (share + extra) / tokens
            out.append(k > 0 and x < min(n, _READ_HORIZON * tokens) * saved)
        return out

    def _shadow_asks(
        self, request_ids: list[str], lengths: list[int], caps: list[int], step: float
    ) -> list[int]:
        """lengths with drafts asked for the skipped requests that have none under judgement, as many as the shadow
        credit pays for at the measured drafting time per request, longest waiting first. step: the step's cost."""
        out = list(lengths)
        waiting = []
        for i, (rid, k, cap) in enumerate(zip(request_ids, lengths, caps)):
            h = self.acceptance.history(rid)
            if k > 0 or cap == 0:
                h.drafted_turn = self._turn()
            elif rid not in self.shadows:
                waiting.append((h, i))
        per = self.request_draft_seconds
        credit = self.shadow_credit + SHADOW_BUDGET * step
        # before the drafting time is known, every waiting request drafts (that measures it)
        n = len(waiting) if per <= 0 else min(len(waiting), int(credit / per))
        waiting.sort(key=lambda t: t[0].drafted_turn)
        for h, i in waiting[:n]:
            out[i] = caps[i]
            h.drafted_turn = self._turn()
        # unspent credit is kept up to a round of shadow drafts for the whole batch
        self.shadow_credit = max(0.0, min(credit - n * per, per * len(request_ids)))
        return out

    def choose(
        self,
        request_ids: list[str],
        drafts: list[list[int]],
        confidence: list[list[float]] | None,
        batch_rows: int,
        draft_seconds: float,
        one_hot: bool = True,
        worth: list[float] | None = None,
    ) -> list[int]:
        """How many of each request's drafts to verify this step (drafting is paid already: draft_seconds).
        one_hot: the drafts are one-hot (no draft distribution), so the ones not verified can be judged as shadows.
        worth: as for `ask`."""
        shadows = self.shadow_drafts and one_hot
        if self.skipping:
            # counted by `skips`
            return [0] * len(drafts)
        if shadows and not any(drafts):
            # nothing was drafted (the ask found that no drafting pays): nothing to weigh
            self.next_draft.clear()
            self.planned_drafts += len(drafts)
            self._planned(0)
            return [0] * len(drafts)
        conf = confidence or [None] * len(drafts)
        gains = [
            expected_gains(self.acceptance.conditional(rid, len(d), c))
            for rid, d, c in zip(request_ids, drafts, conf)
        ]
        cost = self._cost(batch_rows, self._most_rows(batch_rows, [len(d) for d in drafts]))
        lengths = self._plan(gains, cost, lambda k: draft_seconds, batch_rows, worth)
        # what the plan verifies, probes left out: only that ends an idle stretch
        planned = sum(lengths)
        self.next_draft.clear()
        if shadows:
            for rid, d, c, k in zip(request_ids, drafts, conf, lengths):
                if k:
                    # verified drafts teach the model themselves
                    self.shadows.pop(rid, None)
                    if k < len(d):
                        self.next_draft[rid] = (d[k], c[k] if c is not None and k < len(c) else None)
                elif d and rid not in self.shadows:
                    self.shadows[rid] = _Shadow(list(d), None if c is None else list(c))
        else:
            # a request the ask skipped (no drafts, a cap above 0) was skipped by the planner too
            caps = [max(len(d), self.caps.get(rid, 0)) for rid, d in zip(request_ids, drafts)]
            has_drafts = [bool(d) for d in drafts]
            lengths = self._probe(
                request_ids, lengths, caps, cost, batch_rows + sum(lengths), count=True, has_drafts=has_drafts
            )
        self.planned_tokens += sum(lengths)
        self.planned_drafts += len(lengths)
        self._planned(planned)
        return lengths

    def choose_nodes(
        self,
        request_ids: list[str],
        parents: list[list[int]],
        depths: list[list[int]],
        confidence: list[list[float]],
        batch_rows: int,
        draft_seconds: float,
        worth: list[float] | None = None,
    ) -> int:
        """How many nodes of each request's token tree to verify this step (a prefix of its nodes, which the
        drafter orders by path confidence so that every prefix is a tree): the node budget. Trees in one step
        share a node count, so it is the largest of the requests' own choices; 0 verifies no draft. worth: as for
        `ask`."""
        if self.skipping:
            return 0
        gains = [self.acceptance.node_gains(p, d, c) for p, d, c in zip(parents, depths, confidence)]
        cost = self._cost(batch_rows, self._most_rows(batch_rows, [len(g) for g in gains]))
        lengths = self._plan(gains, cost, lambda k: draft_seconds, batch_rows, worth)
        n = planned = max(lengths, default=0)
        # trees share a node count: with none chosen, any probe makes every tree verify one node
        lengths = self._probe(
            request_ids,
            lengths,
            [len(g) for g in gains],
            cost,
            batch_rows + n * len(lengths),
            count=True,
            probe_rows=lambda j: len(lengths) if j and not n else 0,
        )
        n = max(lengths, default=0)
        self.planned_tokens += n * len(lengths)
        self.planned_drafts += len(lengths)
        self._planned(planned)
        return n

    def _planned(self, drafts: int) -> None:
        """A step's plan verified this many drafts (probes not counted): planned steps that verify nothing make the
        planner skip planning for a few steps (IDLE_SKIP_MAX); a skipped step changes nothing."""
        if self.skipping:
            return
        if drafts:
            self.idle_plans = 0
        else:
            self.idle_plans += 1
            self.skip_left = max(0, min(self.idle_plans - IDLE_AFTER + 1, IDLE_SKIP_MAX))

    def observe_tree(
        self, parents: list[int], depths: list[int], confidence: list[float], on_path: list[bool]
    ) -> None:
        self.acceptance.observe_tree(parents, depths, confidence, on_path)

    def _most_rows(self, batch_rows: int, lengths: list[int]) -> int:
        """The most rows a plan over drafts of these lengths may weigh."""
        return min(self.max_rows, batch_rows + sum(lengths))

    def _plan(
        self,
        gains: list[list[float]],
        cost: Callable[[int], float],
        draft_cost: Callable[[int], float],
        batch_rows: int,
        worth: list[float] | None = None,
    ):
        """plan_lengths with this planner's row limit, GAIN_DISCOUNT and the engine's recent speedup; in a closed
        batch (worth given) each request's gains weighed by its worth."""
        if worth is not None:
            gains = [[g * w for g in row] for row, w in zip(gains, worth)]
        speedup = self.speedup()
        return plan_lengths(gains, cost, draft_cost, self.max_rows, batch_rows, GAIN_DISCOUNT, speedup)

    def token_worth(self, left: list[int], runs: float = 1.0) -> list[float]:
        """closed_batch_worth for a step whose requests (all of them, in order) have these steps left, priced
        by the target's plain step over that many sequences (StepCostModel.plain_batch: an ended request saves its
        row and its own keys and values). runs: the probability that the batch lasts as long as `left` says (below 1
        where requests may end early: `chance_to_run`); otherwise its end is unknown and a token is worth 1, as in
        an open batch (any request may turn out to be the one the batch waits for)."""
        return [1.0 - runs * (1.0 - w) for w in closed_batch_worth(left, self.step_cost.plain_batch)]

    def observe_step(self, tokens: int, rows: int, longest_draft: int, plain_rows: int) -> None:
        """A decode step that committed `tokens`, scoring `rows` rows (plain_rows without drafts) after drafting up
        to longest_draft tokens. Its seconds are the cost models' (the ones the plan weighs them against)."""
        cost = self._cost(plain_rows)
        # reading a backlog counts too: the engine's rate pays for every catch-up it took
        seconds = cost(rows) + self.draft_cost(longest_draft) + self.read_spent
        self.read_spent = 0.0
        # in units of the plain step at this batch size: tokens per row, seconds per plain step
        self.step_tokens = self.step_tokens * _SPEEDUP_DECAY + tokens / plain_rows
        self.step_seconds = self.step_seconds * _SPEEDUP_DECAY + seconds / cost(plain_rows)
        self.steps_seen += 1

    def speedup(self) -> float | None:
        """Tokens per second over the recent decode steps relative to plain decoding's at the same batch sizes
        (decaying weights), None before _SPEEDUP_AFTER steps."""
        if self.steps_seen < _SPEEDUP_AFTER or self.step_seconds <= 0:
            return None
        return self.step_tokens / self.step_seconds

    def _turn(self) -> int:
        self.turns += 1
        return self.turns

    def _probe(
        self,
        request_ids: list[str],
        lengths: list[int],
        caps: list[int],
        cost: Callable[[int], float],
        base_rows: int,
        count: bool,
        has_drafts: list[bool] | None = None,
        probe_rows: Callable[[int], int] = lambda j: j,
    ) -> list[int]:
        """lengths with one draft for each due request (skipped PROBE_AFTER steps in a row) that the probe credit
        pays for, longest skipped first. cost(rows): the step's cost; base_rows: its rows without probes;
        probe_rows(j): the rows j probes add (a chain: one draft each). count: this is the step's final choice (skip
        counts and the credit move), not the ask. has_drafts: which requests have a draft to verify (default all);
        the others wait."""
        out = list(lengths)
        due = []
        for i, (rid, k, cap) in enumerate(zip(request_ids, lengths, caps)):
            h = self.acceptance.history(rid)
            if k > 0 or cap == 0:
                if count:
                    h.idle_steps = 0
            elif h.idle_steps >= PROBE_AFTER and (has_drafts is None or has_drafts[i]):
                due.append((h, i))
            elif count:
                h.idle_steps += 1
        now = cost(base_rows)
        if count:
            self.last_step_cost = now
        due.sort(key=lambda t: -t[0].idle_steps)
        # a drafter with a forward drafts for each probed request (the engine's drafters run only the ones asked),
        # after reading its positions since it last drafted: read[j] prices the first j due requests' reading
        each = self.probe_drafting if self.runs_forward else 0.0
        read = list(accumulate((self.reading.get(request_ids[i], 0.0) for _, i in due), initial=0.0))

        def extra(j: int) -> float:
            return cost(base_rows + probe_rows(j)) - now + j * each + read[j] if j else 0.0

        credit = self.probe_credit + PROBE_BUDGET * now
        # the most probes the credit covers (an extra row's cost need not grow with the rows: AMX tiles)
        n = max(j for j in range(len(due) + 1) if extra(j) <= credit)
        for j, (h, i) in enumerate(due):
            if j < n:
                out[i] = 1
            if count:
                h.idle_steps = 0 if j < n else h.idle_steps + 1
        if count:
            # unspent credit is kept up to what probing the whole batch at once would cost, and at most one request's
            # reading (the dearest): enough for any single probe, no store for a burst of them
            b = len(request_ids)
            most = max((self.reading.get(r, 0.0) for r in request_ids), default=0.0)
            whole = cost(base_rows + probe_rows(b)) - now + b * each + most
            self.probe_credit = min(credit - extra(n), whole)
        return out

    def _cost(self, plain_rows: int, most_rows: int = 0) -> Callable[[int], float]:
        """The target step's seconds by its rows, with the fixed cost of verifying once it scores more rows than
        its plain step (plain_rows); read from a table up to most_rows (a plan's row counts), computed beyond."""
        model = self.step_cost
        table = model.table(plain_rows, most_rows) if most_rows else []
        n = len(table)
        return lambda rows: table[rows] if rows < n else model.cost(rows, drafted=rows > plain_rows)

    def observe(
        self, request_id: str, num_drafts: int, num_accepted: int, confidence=None, tokens: Sequence[int] = ()
    ) -> None:
        """A verified chain, and the tokens the step committed for it (accepted drafts, then the target's own). With
        every draft accepted, the target's token judges the first draft that was not verified (a shadow draft, judged
        at no cost), so deep draft positions are learned even while the planner stops short of them."""
        self.acceptance.observe(request_id, num_drafts, num_accepted, confidence)
        nxt = self.next_draft.pop(request_id, None)
        if nxt is not None and num_accepted == num_drafts and len(tokens) > num_accepted:
            self.acceptance.observe_one(request_id, num_drafts, tokens[num_accepted] == nxt[0], nxt[1])

    def committed(self, request_id: str, tokens: Sequence[int]) -> None:
        """Tokens a request committed in a step that verified none of its drafts: they judge its shadow drafts in
        order, up to the first that differs (the positions after it were never reached, as after a rejection)."""
        s = self.shadows.get(request_id)
        if s is None:
            return
        for tok in tokens:
            i = s.judged
            hit = tok == s.drafts[i]
            conf = s.confidence[i] if s.confidence is not None and i < len(s.confidence) else None
            self.acceptance.observe_one(request_id, i, hit, conf)
            s.judged += 1
            if not hit or s.judged == len(s.drafts):
                del self.shadows[request_id]
                return

    def remove(self, request_id: str) -> None:
        self.acceptance.remove(request_id)
        self.newest.pop(request_id, None)
        self.shadows.pop(request_id, None)
        self.next_draft.pop(request_id, None)
        self.known.discard(request_id)

    def observe_verified(
        self,
        request_ids: list[str],
        spec: SpecDecodeMetadata,
        confidence: list[list[float] | None] | None,
        step: StepTokens,
        rows: int,
        seconds: float,
        longest_ask: int,
    ) -> None:
        """A decode step's forward and verification, `rows` scored in `seconds`: the step cost's online fit, then
        what each request's drafts taught (verified ones, or shadows judged by the tokens it committed). A tree
        step teaches per node and per accepted depth."""
        tree = spec.tree
        self.step_cost.observe(rows, seconds, drafted=tree is not None or any(spec.draft_token_ids))
        self.observed_steps += 1
        if tree is not None:
            self._observe_tree_step(request_ids, tree, confidence, step)
            return
        self.observe_step(len(request_ids) + sum(step.num_accepted), rows, longest_ask, len(request_ids))
        for b, (rid, d, n) in enumerate(zip(request_ids, spec.draft_token_ids, step.num_accepted)):
            # (a cheap drafter's next draft judges the bonus token's depth already)
            judged = rid in self.next_draft
            if d:
                self.observe(rid, len(d), n, confidence[b] if confidence else None, step.tokens[b])
            else:
                # drafts it did not verify are judged against the token it commits
                self.committed(rid, step.tokens[b])
            if n == len(d) and not judged and len(step.tokens[b]) > n:
                self.newest[rid] = (n, self.observed_steps, step.tokens[b][n])

    def hindsight(self, request_ids: list[str], picks: Sequence[tuple[int, float | None] | None]) -> None:
        """A drafter with a forward of its own re-reads a request's newest committed token when it catches up: its
        greedy pick for that token from the context before it (and its confidence) is the draft it would have made
        there, at the depth the last decode step reached with every verified draft accepted (the bonus token; 0
        after a step without drafts). Judged against the token, it teaches that depth at no cost: without it, the
        depths past a request's planned drafts would not be seen again once an early rejection had put them low.
        Only the newest step's token is judged (a request whose drafter skipped a step has a newer token)."""
        for rid, pick in zip(request_ids, picks):
            newest = self.newest.pop(rid, None)
            if pick is None or newest is None or newest[1] != self.observed_steps:
                continue
            depth, _, token = newest
            if depth < self.k:
                self.acceptance.observe_one(rid, depth, pick[0] == token, pick[1])

    def _observe_tree_step(self, request_ids: list[str], tree, confidence, step: StepTokens) -> None:
        if confidence is not None and tree.host_parent is not None:
            for i in range(len(request_ids)):
                self.observe_tree(tree.host_parent[i], tree.host_depth[i], confidence[i], step.on_path[i])
        for i, rid in enumerate(request_ids):
            # the per-position estimates that decide how deep to draft (the ask) learn the accepted depth
            depth = tree.max_depth if tree.host_depth is None else max(tree.host_depth[i])
            self.observe(rid, depth, step.num_accepted[i])

    def report(self, counters) -> None:
        """The planner's figures into the engine's counters (metrics, the server's gauges)."""
        counters.mean_chosen_k = self.mean_chosen_k
        counters.verified_row_cost = self.verified_row_cost()

    def log_line(self) -> str:
        return f", Planner: mean chosen K {self.mean_chosen_k:.2f}, verified row cost {self.verified_row_cost():.2f}"

    def verified_row_cost(self) -> float:
        """What one more scored row costs relative to a plain batch-1 step, over num_speculative_tokens rows (the
        fixed cost of verifying included): (C(1 + K) - C(1)) / (K * C(1)); 0.2 means verifying 4 drafts costs
        1.8x a plain step."""
        k, cost = max(1, self.k), self._cost(1)
        return max(0.0, cost(1 + k) / cost(1) - 1.0) / k

    @property
    def mean_chosen_k(self) -> float:
        return self.planned_tokens / self.planned_drafts if self.planned_drafts else 0.0
