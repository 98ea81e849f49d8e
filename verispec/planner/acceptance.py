"""The acceptance model: P(draft i accepted | the drafts before it accepted), learned online.

A base rate per draft position (or per draft position and confidence bin when the proposer says how sure it is, as
suffix decoding does), shared across requests, times a per-request factor from the request's own recent history.
Plain Python on host numbers, tested on its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def expected_gains(cond: Sequence[float]) -> list[float]:
    """Conditional acceptance rates of drafts 1..k -> P(drafts 1..i all accepted) for i = 1..k (non-increasing):
    the expected extra tokens the i-th draft adds."""
    out, p = [], 1.0
    for a in cond:
        p *= a
        out.append(p)
    return out


# conditional acceptance estimates stay inside (floor, ceiling): a draft is never certain, nor hopeless
_FLOOR, _CEILING = 0.01, 0.98


_CONF_BINS = 10


# confidence is calibrated separately for the first draft, the second, and the rest: the same stated confidence
# means more at the first position (suffix decoding's first draft is accepted more often than a deep one)
_CONF_DEPTHS = 3


@dataclass
class _Rate:
    """A decayed success count with a prior: (hits + prior * strength) / (trials + strength)."""

    prior: float
    strength: float = 2.0
    hits: float = 0.0
    trials: float = 0.0

    def value(self, prior: float | None = None) -> float:
        """prior: instead of the rate's own (an estimate borrowed while this rate has few trials)."""
        p = self.prior if prior is None else prior
        return (self.hits + p * self.strength) / (self.trials + self.strength)

    def observe(self, hit: bool, decay: float) -> None:
        self.hits = self.hits * decay + float(hit)
        self.trials = self.trials * decay + 1.0


@dataclass
class _RequestHistory:
    # per draft position, decayed accepted drafts and the shared estimate's predictions for them: the request's
    # correction there is their ratio. predicted: what the estimate each draft was judged by said (its confidence
    # bin's rate where it had one); expected: what the position's rate alone said. Each corrects its own estimate:
    # a request whose confident drafts keep being accepted is as its confidence said, yet far above its position's
    # rate, which is all the ask has before its drafts exist
    accepted: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    expected: list[float] = field(default_factory=list)
    # speculating steps in a row that verified no draft (probing after PROBE_AFTER of them)
    idle_steps: int = 0
    # when the request last drafted, in the planner's count of drafting turns (shadow drafts go to the longest
    # waiting first; -1: never)
    drafted_turn: int = -1
    # (the model's version, its conditional estimates without confidence, their expected gains): kept until the
    # request's history or a shared position estimate changes
    memo: tuple[int, list[float], list[float]] | None = None
    # whether the request's last judged draft was accepted (None before any): its next first draft is estimated by
    # the shared rate after that outcome
    last_hit: bool | None = None


@dataclass
class AcceptanceModel:
    """Online estimates of conditional draft acceptance: a shared estimate per draft position, or per draft
    position (first, second, later) and proposer-confidence bin (learned across requests: the method's prior),
    times a per-request, per-position correction (accepted / predicted over the request's recent drafts, shrunk
    towards 1)."""

    num_positions: int
    prior: float = 0.6
    # per-step decay of the shared and per-request counts (effective memories of ~200 and ~10 steps)
    shared_decay: float = 0.995
    request_decay: float = 0.9
    request_strength: float = 2.0
    positions: list[_Rate] = field(default_factory=list)
    # the first position's rate after a request's last judged draft was rejected, and after it was accepted: drafts
    # come in streaks (a copied span, a recalled answer), so a first draft right after an accepted one is likelier
    # (recalled suffix answers: 0.98 against 0.3 at an answer's start)
    after: list[_Rate] = field(default_factory=list)
    # [_CONF_DEPTHS][_CONF_BINS]
    confidence: list[list[_Rate]] = field(default_factory=list)
    requests: dict[str, _RequestHistory] = field(default_factory=dict)
    # the shared estimates of the first positions (_position_value) until a rate observes: the planner reads them
    # for every request of every step
    _values: list[float] | None = field(default=None, repr=False)
    # bumped whenever a shared position estimate changes (per-request memos of `conditional` are kept until then)
    _version: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.positions = [_Rate(self.prior) for _ in range(self.num_positions)]
        self.after = [_Rate(self.prior), _Rate(self.prior)]
        # a bin's prior is its centre: a calibrated proposer needs no correction
        self.confidence = [
            [_Rate((j + 0.5) / _CONF_BINS) for j in range(_CONF_BINS)] for _ in range(_CONF_DEPTHS)
        ]

    def _rate(self, pos: int, conf: float | None) -> _Rate:
        if conf is not None:
            return self.confidence[min(pos, _CONF_DEPTHS - 1)][_bin(conf)]
        return self.positions[min(pos, self.num_positions - 1)]

    def _position_value(self, pos: int) -> float:
        """The shared estimate of draft position pos (clamped to the last). A position's prior is the estimate of the
        position before it: a draft position the planner has seldom verified is assumed as good as the last one it
        knows (n-gram drafts deep in a match are accepted as often as shallow ones), so the planner tries it and
        learns, instead of keeping a fixed prior forever. Computed as far as asked and cached until a rate
        observes."""
        pos = min(pos, self.num_positions - 1)
        values = self._values
        if values is None:
            values = self._values = [self.positions[0].value()]
        while len(values) <= pos:
            values.append(self.positions[len(values)].value(prior=values[-1]))
        return values[pos]

    def _base(self, pos: int, conf: float | None) -> float:
        if conf is not None:
            return self._rate(pos, conf).value()
        return self._position_value(pos)

    def _plain_base(self, pos: int, h: _RequestHistory | None) -> float:
        """The estimate without confidence of draft position pos for a request: the first position's after the
        request's last judged outcome (the position's own rate as its prior), else the position's."""
        if pos == 0 and h is not None and h.last_hit is not None:
            return self.after[h.last_hit].value(prior=self._position_value(0))
        return self._position_value(pos)

    def history(self, request_id: str) -> _RequestHistory:
        h = self.requests.get(request_id)
        if h is None:
            n = self.num_positions
            h = self.requests[request_id] = _RequestHistory([0.0] * n, [0.0] * n, [0.0] * n)
        return h

    def conditional(self, request_id: str, k: int, confidence: Sequence[float] | None = None) -> list[float]:
        """Estimated P(draft i accepted | drafts before it accepted) for i = 1..k."""
        conf = confidence or ()
        h = self.requests.get(request_id)
        # the usual call (no confidence) is memoised per request until an estimate changes
        if not conf and (memo := self._memo(h, k)) is not None:
            return memo[1][:k]
        last, m = self.num_positions - 1, self.request_strength
        out = []
        for i in range(k):
            c = conf[i] if i < len(conf) else None
            base = self._plain_base(i, h) if c is None else self._base(i, c)
            if h is not None:
                j = min(i, last)
                base *= (h.accepted[j] + m) / ((h.expected if c is None else h.predicted)[j] + m)
            out.append(min(_CEILING, max(_FLOOR, base)))
        if h is not None and not conf:
            h.memo = (self._version, out[:], expected_gains(out))
        return out

    def observe(
        self, request_id: str, num_drafts: int, num_accepted: int, confidence: Sequence[float] | None = None
    ) -> None:
        """A verified chain: drafts 1..num_accepted accepted, draft num_accepted + 1 (if any) rejected."""
        conf = list(confidence or ())
        # positions past the first rejection were never judged: they teach nothing
        for i in range(min(num_drafts, num_accepted + 1)):
            self.observe_one(request_id, i, i < num_accepted, conf[i] if i < len(conf) else None)

    def observe_one(self, request_id: str, pos: int, hit: bool, confidence: float | None = None) -> None:
        """One judged draft at position pos (0-based) of a chain whose drafts before it were accepted."""
        h = self.history(request_id)
        j = min(pos, self.num_positions - 1)
        h.accepted[j] = h.accepted[j] * self.request_decay + float(hit)
        plain = self._plain_base(pos, h)
        judged_by = plain if confidence is None else self._base(pos, confidence)
        h.predicted[j] = h.predicted[j] * self.request_decay + judged_by
        h.expected[j] = h.expected[j] * self.request_decay + plain
        if confidence is not None:
            self._rate(pos, confidence).observe(hit, self.shared_decay)
            # (drafts without confidence keep their position's rate: n-gram matches that fail start new ones)
            if pos == 0 and h.last_hit is not None:
                self.after[h.last_hit].observe(hit, self.shared_decay)
            h.last_hit = hit
        # the position's estimate learns from every judged draft, whatever its confidence: it is what a request's
        # drafts are expected to do before they exist (the ask), so it must follow the method's acceptance (suffix
        # drafts that turn from guesses into recalled answers) instead of staying at its prior
        self._rate(pos, None).observe(hit, self.shared_decay)
        h.memo = None
        # a shared position estimate moved: every request's memo is stale
        self._changed()

    def gains(self, request_id: str, k: int) -> list[float]:
        """expected_gains of the request's first k drafts (no confidence), memoised with the estimates."""
        memo = self._memo(self.requests.get(request_id), k)
        if memo is not None:
            return memo[2][:k]
        return expected_gains(self.conditional(request_id, k))

    def _memo(self, h: _RequestHistory | None, k: int) -> tuple[int, list[float], list[float]] | None:
        """The request's memo if it is current and covers k drafts."""
        memo = h.memo if h is not None else None
        return memo if memo is not None and memo[0] == self._version and len(memo[1]) >= k else None

    def _changed(self) -> None:
        self._values = None
        self._version += 1

    def node_gains(
        self, parents: Sequence[int], depths: Sequence[int], confidence: Sequence[float]
    ) -> list[float]:
        """A token tree's nodes 1..N (parents[j], depths[j] with node 0 the root; confidence[j - 1] the drafter's
        probability of node j's token at its parent) -> per node P(its path is accepted): the product of the
        calibrated conditional estimates along the path, made non-increasing in node order (a prefix of the
        nodes is what a step keeps)."""
        path = [1.0]
        out, low = [], 1.0
        for j in range(1, len(parents)):
            c = self._base(depths[j] - 1, confidence[j - 1])
            path.append(path[parents[j]] * min(_CEILING, max(_FLOOR, c)))
            low = min(low, path[j])
            out.append(low)
        return out

    def observe_tree(
        self,
        parents: Sequence[int],
        depths: Sequence[int],
        confidence: Sequence[float],
        on_path: Sequence[bool],
    ) -> None:
        """A verified tree: every node whose parent was accepted was judged (accepted iff on the accepted path);
        the calibration of its (depth, confidence) bin learns from it. Nodes below a rejected one teach nothing."""
        for j in range(1, len(parents)):
            if on_path[parents[j]]:
                self._rate(depths[j] - 1, confidence[j - 1]).observe(bool(on_path[j]), self.shared_decay)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


def _bin(conf: float) -> int:
    return min(_CONF_BINS - 1, max(0, int(conf * _CONF_BINS)))
