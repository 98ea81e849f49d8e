"""The kernel sources ship with the package, and a machine that cannot build them still runs (float32)."""

from __future__ import annotations

import fnmatch
import warnings
from pathlib import Path

import pytest

from verispec.kernels import build

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_source_is_package_data():
    """A wheel (non-editable install) holds every C file build.py compiles."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["verispec.kernels"]
    sources = [*build.SOURCES, build.AMX_SOURCE, *build.SOURCES[0].parent.glob("*.h")]
    for path in sources:
        assert any(fnmatch.fnmatch(path.name, g) for g in globs), path.name


def test_torch_is_a_dependency_the_pin_satisfies():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch>=2.4" in deps
    assert 'pip install -q "torch==2.13.0"' in (ROOT / "scripts" / "install.sh").read_text()


@pytest.mark.parametrize("error", [FileNotFoundError("qgemm.c"), RuntimeError("anything else")])
def test_kernels_that_cannot_be_built_fall_back_with_one_warning(monkeypatch, error):
    if build.kernel_isa() is None:
        pytest.skip("no AVX2/FMA CPU: the kernels are never built here")

    def broken(isa, sources=build.SOURCES):
        raise error

    monkeypatch.delenv("VERISPEC_KERNELS", raising=False)
    monkeypatch.setattr(build, "build_qgemm", broken)
    build.load_qgemm.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert build.load_qgemm() is None
    finally:
        build.load_qgemm.cache_clear()
    assert len(caught) == 1 and "dequantized to float32" in str(caught[0].message)
