"""build_engine's defaults."""

from __future__ import annotations


def test_the_kv_budget_reads_available_not_free_memory():
    from verispec.engine.builder import available_memory

    meminfo = "MemTotal:       24000000 kB\nMemFree:          100000 kB\nMemAvailable:   20000000 kB\n"
    assert available_memory(meminfo) == 20000000 << 10
    # no MemAvailable line (an old kernel): the free pages
    assert available_memory("MemTotal: 1 kB\n") > 0
