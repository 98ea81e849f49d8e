"""Which cores each tensor-parallel rank runs on (verispec/distributed/cpus.py): the topology read from sysfs, ranks
spread over NUMA nodes, VERISPEC_CPU_BIND, and binding a whole process."""

from __future__ import annotations

import os
import re
import threading

import pytest

from verispec.distributed.cpus import (
    bind_process,
    cpulist,
    numa_nodes,
    parse_cpulist,
    rank_cores,
    split_cores,
)


def test_cpulists_parse_as_the_kernel_writes_them():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5]
    assert parse_cpulist("") == []
    assert cpulist([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11" and cpulist([5]) == "5" and cpulist([]) == ""
    assert parse_cpulist(cpulist([0, 2, 3, 4, 9])) == [0, 2, 3, 4, 9]
    for bad in ("3-1", "a", "1-b", "-2"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_numa_nodes_in_node_order(tmp_path):
    for node, cpus in (("node0", "0-3,8-11"), ("node1", "4-7,12-15"), ("node10", "16"), ("node2", "")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    (tmp_path / "online").write_text("0-2,10\n")
    # a node without cores (memory only) is left out
    assert numa_nodes(tmp_path) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15], [16]]
    assert numa_nodes(tmp_path / "missing") == []


TWO_SOCKETS = [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_one_rank_per_node_where_there_are_enough():
    assert split_cores(TWO_SOCKETS, list(range(8)), 2) == TWO_SOCKETS
    four = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_cores(four, list(range(8)), 2) == TWO_SOCKETS
    assert split_cores(four, list(range(8)), 4) == four


def test_ranks_sharing_a_node_split_its_cores():
    assert split_cores(TWO_SOCKETS, list(range(8)), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # one node (this VM): halves
    assert split_cores([[0, 1]], [0, 1], 2) == [[0], [1]]
    # no topology: the allowed cores as one node
    assert split_cores([], [2, 3, 5], 3) == [[2], [3], [5]]


def test_only_allowed_cores_are_handed_out():
    # a cpuset of one core per node and two more of node 0
    assert split_cores(TWO_SOCKETS, [0, 1, 2, 4], 2) == [[0, 1, 2], [4]]
    # node 1 entirely outside the cpuset: both ranks on node 0
    assert split_cores(TWO_SOCKETS, [0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    # ranks given to nodes as evenly as they go: node 0's one core to one rank, node 1's three to two
    assert split_cores(TWO_SOCKETS, [0, 4, 5, 6], 3) == [[0], [4], [5, 6]]
    # a node with fewer cores than its ranks: every allowed core shared out instead
    assert split_cores(TWO_SOCKETS, [0, 4, 5, 6, 7], 4) == [[0], [4], [5], [6, 7]]


def test_the_setting_none_one_rank_and_explicit_lists():
    assert rank_cores(2, "none") is None
    assert rank_cores(1, "auto") is None
    allowed = sorted(os.sched_getaffinity(0))
    assert sorted(sum(rank_cores(1 + (len(allowed) > 1), "auto"), [])) == allowed
    first = str(allowed[0])
    assert rank_cores(2, f"{first}|{first}") == [[allowed[0]], [allowed[0]]]
    with pytest.raises(
        ValueError, match=r"VERISPEC_CPU_BIND='0' gives 1 core list\(s\) for this machine's 2 ranks"
    ):
        rank_cores(2, "0")
    for bad in ("x|y", f"{first}|"):
        with pytest.raises(
            ValueError, match=f"VERISPEC_CPU_BIND='{re.escape(bad)}' is not a list of CPU lists"
        ):
            rank_cores(2, bad)
    with pytest.raises(ValueError, match=r"cores \[100000\] are not among this process's"):
        rank_cores(2, f"{first}|100000")


def test_binding_a_process_moves_its_running_threads_and_is_undone():
    allowed = sorted(os.sched_getaffinity(0))
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    before = bind_process(allowed[:1])
    try:
        assert before == set(allowed)
        assert os.sched_getaffinity(0) == {allowed[0]}
        assert os.sched_getaffinity(other.native_id) == {allowed[0]}
    finally:
        # the rest of this test process keeps its cores whatever happened above
        bind_process(allowed)
        theirs = os.sched_getaffinity(other.native_id)
        stop.set()
        other.join()
    assert os.sched_getaffinity(0) == set(allowed) == theirs
