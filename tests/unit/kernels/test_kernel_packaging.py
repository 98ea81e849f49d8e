"""The kernel sources ship with the package, and a machine that cannot build them still runs (float32)."""

from __future__ import annotations

import fnmatch
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from verispec.kernels import build

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[3]


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


def test_the_build_digest_follows_every_source_header_and_isa(tmp_path):
    """The compiled library's name and the step-cost profiles' cache key carry build_digest: a changed kernel
    source or header, or another instruction set, is another build (a profile of the old kernels is not reused)."""
    for path in (*build.SOURCES, build.AMX_SOURCE, *build.SOURCES[0].parent.glob("*.h")):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    sources = tuple(tmp_path / p.name for p in build.SOURCES)
    base = build.build_digest("avx2", sources)
    assert base == build.build_digest("avx2")
    assert build.build_digest("avx512", sources) != base
    for name in (sources[0].name, next(tmp_path.glob("*.h")).name):
        before = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(before + b"\n// changed\n")
        assert build.build_digest("avx2", sources) != base, name
        (tmp_path / name).write_bytes(before)
    assert build.build_digest("avx2", sources) == base


def test_the_step_cost_profile_is_cached_per_kernel_build(monkeypatch):
    """build_planner's cache key names the kernels' build, not only their instruction set."""
    from verispec.engine import builder

    if build.kernel_isa() is None:
        pytest.skip("no AVX2/FMA CPU: no kernels, no build to name")
    keys = []

    def spy(runner, slot, points, key, batch_slots=None):
        keys.append(key)
        raise StopIteration

    monkeypatch.setattr(builder, "load_or_profile", spy)
    args = SimpleNamespace(max_num_seqs=1, activation_dtype="float32", dtype="float32", keep_quantized=True)
    with pytest.raises(StopIteration):
        builder.build_planner(
            args,
            SimpleNamespace(source=__file__),
            SimpleNamespace(
                device="cpu",
                cache=SimpleNamespace(
                    num_slots=1, t_alloc=64, block_size=16, pool=SimpleNamespace(num_usable=8)
                ),
            ),
            SimpleNamespace(num_lookahead_slots=2),
            None,
            16,
        )
    isa = build.kernel_isa()
    assert (isa, build.build_digest(isa)) in keys[0]
