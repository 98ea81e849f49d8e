"""Ruff lint and format are part of the suite, so style drift fails CI like any other regression."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    exe = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(exe).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [exe]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff(args):
    r = subprocess.run(
        _ruff() + args + ["verispec", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
