"""Every repository path the docs name (README.md and docs/**/*.md) exists, so the map stays true to the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted(ROOT.joinpath("docs").rglob("*.md"))]
# a path starting at one of these folders, up to its last word character (drops a trailing "." or "/")
PATH = re.compile(r"(?<![\w./-])((?:verispec|tests|benchmarks)/[\w./-]*\w)")


def cited_paths(text: str) -> list[str]:
    return sorted(set(PATH.findall(text)))


def test_the_pattern_finds_paths_and_only_paths():
    text = "see `verispec/proposers/base.py`, tests/unit/ and benchmarks/spec_decode.py. "
    text += "Not my_verispec/x.py or a.verispec/y"
    assert cited_paths(text) == ["benchmarks/spec_decode.py", "tests/unit", "verispec/proposers/base.py"]


def test_the_architecture_map_exists():
    assert ROOT / "docs" / "architecture.md" in DOCS


def test_the_dated_benchmark_pages_are_checked():
    assert ROOT / "docs" / "benchmarks" / "README.md" in DOCS


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_path_exists(doc: Path):
    paths = cited_paths(doc.read_text())
    name = doc.relative_to(ROOT).as_posix()
    assert paths, f"{name} names no repository path"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"{name} names paths that do not exist: {missing}"
