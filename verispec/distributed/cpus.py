"""Which cores each tensor-parallel rank of a machine runs on: one rank per NUMA node where there are enough nodes,
as vLLM's CPU backend does, so that a rank's threads and the shard they load (first touched by them) sit on one
node and stream from its own memory; ranks sharing a node split its cores. Pure functions over the topology, and
the one call that applies a binding to a whole process.

VERISPEC_CPU_BIND: `auto` (default), `none` (no binding: each rank's threads go where the OS puts them), or one core
list per rank of this machine separated by `|` (`0-31|32-63`, vLLM's VLLM_CPU_OMP_THREADS_BIND form).
"""

from __future__ import annotations

import os
from pathlib import Path

NODES = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format); ValueError if malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first:
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def cpulist(cpus) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8' (parse_cpulist's inverse)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def numa_nodes(root: Path = NODES) -> list[list[int]]:
    """Each NUMA node's cores, by node number ([] where the topology cannot be read)."""
    nodes = []
    try:
        entries = sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
        for node in entries:
            cpus = parse_cpulist((node / "cpulist").read_text())
            if cpus:
                nodes.append(cpus)
    except (OSError, ValueError):
        return []
    return nodes


def split_cores(nodes: list[list[int]], allowed: list[int], ranks: int) -> list[list[int]]:
    """The cores of each of `ranks` ranks: the allowed cores grouped by node (cores of no node in one group), nodes
    handed to ranks in contiguous runs (each rank a run of whole nodes when there are at least as many nodes, else
    each node's ranks splitting its cores into contiguous shares). Needs ranks <= len(allowed)."""
    free = set(allowed)
    groups = [[c for c in node if c in free] for node in nodes]
    groups = [g for g in groups if g]
    rest = sorted(free - {c for g in groups for c in g})
    if rest:
        groups.append(rest)
    n = len(groups)
    if ranks <= n:
        return [sum(groups[r * n // ranks : (r + 1) * n // ranks], []) for r in range(ranks)]
    out = []
    for g, cores in enumerate(groups):
        mine = (g + 1) * ranks // n - g * ranks // n
        out += [cores[i * len(cores) // mine : (i + 1) * len(cores) // mine] for i in range(mine)]
    if any(not cores for cores in out):
        # more ranks on a node than it has cores: share out all allowed cores instead
        cores = sorted(free)
        out = [cores[r * len(cores) // ranks : (r + 1) * len(cores) // ranks] for r in range(ranks)]
    return out


def rank_cores(ranks: int, setting: str | None = None, root: Path = NODES) -> list[list[int]] | None:
    """The cores of this machine's `ranks` ranks under VERISPEC_CPU_BIND (`setting` overrides it); None: no binding
    (one rank, `none`). ValueError naming VERISPEC_CPU_BIND for a bad list."""
    setting = os.environ.get("VERISPEC_CPU_BIND", "auto") if setting is None else setting
    if ranks == 1 or setting == "none" or not hasattr(os, "sched_setaffinity"):
        # (no affinity calls outside Linux)
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if setting == "auto":
        return split_cores(numa_nodes(root), allowed, ranks)
    lists = setting.split("|")
    if len(lists) != ranks:
        raise ValueError(
            f"VERISPEC_CPU_BIND={setting!r} gives {len(lists)} core list(s) for this machine's {ranks} ranks; "
            "allowed: auto, none, or one list per rank separated by | (0-3|4-7)"
        )
    try:
        out = [parse_cpulist(text) for text in lists]
    except ValueError:
        # refused below, like a rank given no cores
        out = [[]]
    if not all(out):
        raise ValueError(f"VERISPEC_CPU_BIND={setting!r} is not a list of CPU lists such as 0-3|4-7")
    outside = sorted({c for cores in out for c in cores} - set(allowed))
    if outside:
        raise ValueError(
            f"VERISPEC_CPU_BIND={setting!r}: cores {outside} are not among this process's {allowed}"
        )
    return out


def bind_process(cores: list[int]) -> set[int]:
    """Every thread of this process (those running now, and so those they start) onto `cores`; -> the cores it
    could use before, for `bind_process(previous)` to undo it."""
    before = os.sched_getaffinity(0)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            # a thread that ended meanwhile
            pass
    return before
