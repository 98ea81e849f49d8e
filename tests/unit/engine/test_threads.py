"""The thread governor on a simulated machine: each step advances a wall clock and a CPU clock by what a step
would take there with the governor's current thread count."""

from __future__ import annotations

from verispec.engine.threads import ThreadGovernor


class Machine:
    """step(threads) -> (wall seconds, process CPU seconds) of one step; `busy` says whether a neighbour runs."""

    def __init__(self, quiet_share: float = 1.0):
        self.wall = self.cpu = 0.0
        self.busy = False
        self.quiet_share = quiet_share

    def step(self, threads: int) -> tuple[float, float]:
        if threads == 1:
            # one thread on the free core: about its quiet speed either way
            return 0.006, 0.006
        if self.busy:
            # the barrier waits for the thread sharing its core: slow, and the waiter is off the CPU
            return 0.030, 0.030 * 2 * 0.6
        return 0.004, 0.004 * 2 * self.quiet_share


def run(machine: Machine, gov: ThreadGovernor, steps: int) -> list[int]:
    """The thread count of each step."""
    used = []
    for _ in range(steps):
        gov.start()
        wall, cpu = machine.step(gov.current)
        machine.wall += wall
        machine.cpu += cpu
        gov.stop()
        used.append(gov.current)
    return used


def governor(machine: Machine, threads: int = 2) -> tuple[ThreadGovernor, list[int]]:
    calls: list[int] = []
    gov = ThreadGovernor(threads, calls.append, lambda: machine.wall, lambda: machine.cpu)
    return gov, calls


def test_a_quiet_machine_keeps_every_thread():
    m = Machine()
    gov, calls = governor(m)
    assert set(run(m, gov, 2000)) == {2} and calls == []


def test_the_process_setting_is_put_back_after_every_step():
    """Another engine in the process (or the next one built) reads torch's setting: it stays the configured count
    outside the governed steps."""
    m = Machine()
    m.busy = True
    gov, calls = governor(m)
    used = run(m, gov, 500)
    assert used.count(1) > 400
    # each step on one thread sets 1 before it and 2 after it
    assert calls[-1] == 2 and calls.count(1) == calls.count(2)


def test_a_busy_neighbour_gets_one_thread_then_the_machine_back_when_it_leaves():
    m = Machine()
    gov, calls = governor(m)
    run(m, gov, 50)
    m.busy = True
    used = run(m, gov, 3000)
    # one thread within a window or two, and most of the time after
    assert used[:4].count(1) >= 1 and used.count(1) > 0.9 * len(used)
    # probes of both threads, ever rarer: the pause doubles up to its bound
    probes = sum(1 for a, b in zip(used, used[1:]) if (a, b) == (1, 2))
    assert probes >= 2 and gov.pause == gov.max_pause
    m.busy = False
    used = run(m, gov, 5000)
    assert used[-1] == 2 and used[-1000:].count(1) == 0 and gov.pause == gov.first_pause


def test_steps_with_little_parallel_work_do_not_lose_their_threads():
    """A low share from the steps themselves (one thread not faster): back to every thread at once, and no new try
    until the cooldown ends."""
    m = Machine(quiet_share=0.55)
    gov, calls = governor(m)
    used = run(m, gov, 4000)
    tries = sum(1 for a, b in zip([2] + used, used) if (a, b) == (2, 1))
    assert 1 <= tries <= 2 + int(m.wall / gov.cooldown)
    assert used.count(1) < 0.02 * len(used)


def test_one_thread_configured_is_never_governed():
    m = Machine()
    gov, calls = governor(m, threads=1)
    assert not gov.active
