"""How many threads the kernels run with, step by step: all of them while the engine has the cores to itself, one
when another busy process shares them.

With a busy neighbour on one of the cores, every parallel region waits at its closing barrier for the thread that
shares its core with the neighbour, and a step takes several scheduler time slices (3-250x slower, measured). One
thread then runs on whichever core is free at nearly its quiet speed. The sign is the process's CPU time: alone, its
threads are busy (or spin at the barriers) for the whole step, so CPU time / (wall time x threads) stays near 1;
sharing a core, the waiting thread is off the CPU and it falls to about 0.5-0.75. A window of steps below `low`
makes the governor try one thread, and it keeps one thread only if its steps are faster (steps with little parallel
work also show a low share: then it goes back and does not try again for `cooldown` s). On one thread it probes
all threads again after a pause that doubles while the neighbour stays (at most `max_pause` s), so a quiet machine
gets its threads back within seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# one thread must beat all of them by this much per step to be kept
_MARGIN = 1.2


class ThreadGovernor:
    def __init__(
        self,
        threads: int,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.process_time,
        window: float = 0.02,
        low: float = 0.8,
        pause: float = 1.0,
        max_pause: float = 16.0,
        cooldown: float = 10.0,
    ):
        """threads: the configured count (1: nothing to govern); window: seconds of steps judged together (and at
        least 2 steps); low: the CPU share that makes it try one thread; pause: seconds on one thread before the
        first probe of all threads."""
        self.threads, self.current = threads, threads
        self._set, self._clock, self._cpu = set_threads, clock, cpu_clock
        self.window, self.low, self.first_pause, self.max_pause = window, low, pause, max_pause
        self.cooldown, self.pause = cooldown, pause
        self._wall = self._used = 0.0
        self._steps = 0
        self._t0 = self._c0 = 0.0
        # seconds a step took in the last window on the other thread count (None: no comparison pending)
        self._other: float | None = None
        self._probe_at = self._calm_until = 0.0
        self.switches = 0
        self._applied = threads

    @property
    def active(self) -> bool:
        return self.threads > 1

    def start(self) -> None:
        """Before a step: its thread count (torch's setting is the process's: it is put back after the step, so
        nothing else in the process, another engine included, runs with the governor's choice)."""
        self._applied = self.current
        if self._applied != self.threads:
            self._set(self._applied)
        self._t0, self._c0 = self._clock(), self._cpu()

    def stop(self) -> None:
        """After a step: judge the window once it spans `window` seconds and 2 steps."""
        now = self._clock()
        self._wall += now - self._t0
        self._used += self._cpu() - self._c0
        self._steps += 1
        if self._applied != self.threads:
            self._set(self.threads)
        if self._wall < self.window or self._steps < 2:
            return
        share = self._used / (self._wall * self.current)
        per_step = self._wall / self._steps
        self._wall = self._used = 0.0
        self._steps = 0
        if self.current == 1:
            self._judge_one(now, per_step)
        else:
            self._judge_all(now, share, per_step)

    def _judge_all(self, now: float, share: float, per_step: float) -> None:
        other, self._other = self._other, None
        if share >= self.low or now < self._calm_until:
            # the cores are ours (again): a later neighbour is met with the first pause
            self.pause = self.first_pause
            return
        if other is not None:
            # a probe on a machine still shared: all threads stay only if their steps are faster than one's were
            if per_step >= other:
                self._switch(1)
                self._probe_at = now + self.pause
            return
        # try one thread; it is kept if its steps are faster
        self._other = per_step
        self._switch(1)
        self._probe_at = now + self.pause

    def _judge_one(self, now: float, per_step: float) -> None:
        other, self._other = self._other, None
        if other is not None and per_step * _MARGIN > other:
            # one thread is not faster: the low share was the steps' own (little parallel work)
            self._calm_until = now + self.cooldown
            self._switch(self.threads)
            return
        if now >= self._probe_at:
            self._other = per_step
            self._switch(self.threads)
            self.pause = min(2 * self.pause, self.max_pause)

    def _switch(self, n: int) -> None:
        """From the next step on."""
        self.current = n
        self.switches += 1
