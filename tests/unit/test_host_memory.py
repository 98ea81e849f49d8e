"""verispec/engine/host_memory.py: glibc's thresholds are set once, and nothing happens elsewhere."""

import platform

from verispec.engine import host_memory


def test_glibc_keeps_freed_memory_and_others_are_left_alone():
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert host_memory.keep_freed_memory() is glibc
    # once per process: the second call is the cached answer
    assert host_memory.keep_freed_memory() is glibc


def test_a_non_glibc_system_changes_nothing(monkeypatch):
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("musl", ""))
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        host_memory.keep_freed_memory.cache_clear()
