"""verispec/progress.py: bars are drawn on stderr only where it is a terminal, and nowhere after --quiet."""

from __future__ import annotations

import io
import sys

from verispec import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _stderr(monkeypatch, stream: io.StringIO) -> io.StringIO:
    # set in the test body: pytest's output capture puts its own sys.stderr back between setup and call
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(progress, "_quiet", False)
    return stream


def test_a_terminal_gets_a_bar(monkeypatch):
    err = _stderr(monkeypatch, _Terminal())
    assert progress.enabled()
    for _ in progress.bar(range(3), desc="work"):
        pass
    assert "work" in err.getvalue() and "3/3" in err.getvalue()


def test_quiet_draws_nothing(monkeypatch):
    err = _stderr(monkeypatch, _Terminal())
    progress.set_quiet(True)
    assert not progress.enabled()
    assert list(progress.bar(range(3), desc="work")) == [0, 1, 2]
    assert err.getvalue() == ""


def test_no_terminal_no_bar(monkeypatch):
    err = _stderr(monkeypatch, io.StringIO())
    assert not progress.enabled()
    list(progress.bar(range(3), desc="work"))
    assert err.getvalue() == ""
