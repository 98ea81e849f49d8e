"""The repacked-layout cache (verispec/loader/layout_cache.py): a GGUF's second load rebuilds the very model of its
first (every weight's bytes and every tensor equal, the same tokens) without reading its tensors, in both numerics;
a changed file, a damaged entry, a read-only or disabled cache fall back to the GGUF; old entries are pruned."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import write_tiny_gguf
from verispec import LLM, SamplingParams
from verispec.kernels.arena import slot_weight, weight_slots
from verispec.kernels.build import int8_isa, load_qgemm
from verispec.loader import gguf, layout_cache
from verispec.loader.checkpoint import load_checkpoint

pytestmark = pytest.mark.skipif(
    load_qgemm() is None, reason="no kernel library: GGUF weights are not kept quantized"
)

CPU = torch.device("cpu")
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
DTYPES = ("float32", "int8") if int8_isa() is not None else ("float32",)


@pytest.fixture(scope="module")
def gguf_files(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layout")
    return {
        "q4": write_tiny_gguf(Path(tiny_llama), root / "q4.gguf"),
        "mixed": write_tiny_gguf(
            Path(tiny_llama), root / "mixed.gguf", "Q4_1", "Q8_0", v_type="Q8_0", embed_type="Q8_0"
        ),
    }


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VERISPEC_LAYOUT_CACHE", str(tmp_path / "layouts"))
    return tmp_path / "layouts"


@pytest.fixture
def gguf_reads(monkeypatch) -> list[str]:
    """The GGUF files whose tensors were read."""
    reads, real = [], gguf._load_tensors
    monkeypatch.setattr(
        gguf, "_load_tensors", lambda header, *a, **k: reads.append(header.path) or real(header, *a, **k)
    )
    return reads


def same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    wa, wb = weight_slots(a), weight_slots(b)
    assert [(n, i) for n, _, i in wa] == [(n, i) for n, _, i in wb]
    for (_, ma, i), (_, mb, _) in zip(wa, wb):
        qa, qb = slot_weight(ma, i), slot_weight(mb, i)
        assert (qa.fmt, qa.shape) == (qb.fmt, qb.shape)
        assert np.array_equal(qa.blocks.view(np.uint8), qb.blocks.view(np.uint8))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["q4", "mixed"])
def test_second_load_is_the_first_without_reading_the_gguf(gguf_files, cache, gguf_reads, dtype, which):
    path = str(gguf_files[which])
    first = load_checkpoint(path, CPU, activation_dtype=dtype)
    assert len(list(cache.glob("*.json"))) == 1 and gguf_reads == [Path(path)]
    second = load_checkpoint(path, CPU, activation_dtype=dtype)
    assert gguf_reads == [Path(path)]
    same_model(first.model, second.model)
    assert second.model.fused is not None
    # every weight is the cache file, mapped read-only (nothing copied)
    blocks = [slot_weight(m, i).blocks for _, m, i in weight_slots(second.model)]
    assert blocks and not any(b.flags.writeable for b in blocks)
    os.environ["VERISPEC_LAYOUT_CACHE"] = "0"
    plain = LLM(path, max_model_len=64, max_num_seqs=2, activation_dtype=dtype)
    os.environ["VERISPEC_LAYOUT_CACHE"] = str(cache)
    cached = LLM(path, max_model_len=64, max_num_seqs=2, activation_dtype=dtype)
    prompts = [{"prompt_token_ids": [1, 5, 9, 14]}, {"prompt_token_ids": [3, 3, 7]}]
    assert [o.outputs[0].token_ids for o in cached.generate(prompts, SP, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in plain.generate(prompts, SP, use_tqdm=False)
    ]


def test_each_numerics_has_its_entry(gguf_files, cache):
    for dtype in DTYPES:
        load_checkpoint(str(gguf_files["q4"]), CPU, activation_dtype=dtype)
    assert len(list(cache.glob("*.json"))) == len(DTYPES)


def test_a_changed_file_is_read_again(gguf_files, cache, gguf_reads, tmp_path):
    path = tmp_path / "copy.gguf"
    path.write_bytes(gguf_files["q4"].read_bytes())
    load_checkpoint(str(path), CPU)
    path.write_bytes(gguf_files["mixed"].read_bytes())
    changed = load_checkpoint(str(path), CPU)
    assert gguf_reads == [path, path]
    same_model(changed.model, load_checkpoint(str(gguf_files["mixed"]), CPU).model)


@pytest.mark.parametrize("damage", ["short", "long", "tensors", "index"])
def test_a_damaged_entry_is_dropped_and_the_gguf_read(gguf_files, cache, gguf_reads, damage):
    path = str(gguf_files["q4"])
    first = load_checkpoint(path, CPU)
    stem = next(cache.glob("*.json")).with_suffix("")

    def replace(suffix: str, data: bytes) -> None:
        # a new file in its place (the first model maps the old one, as any process still running would)
        tmp = stem.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, stem.with_suffix(suffix))

    if damage in ("short", "long"):
        data = stem.with_suffix(".bin").read_bytes()
        replace(".bin", data[:-100] if damage == "short" else data + b"x")
    elif damage == "tensors":
        replace(".safetensors", b"not safetensors")
    else:
        replace(".json", b'{"version": 2, "bytes": 5')
    again = load_checkpoint(path, CPU)
    assert gguf_reads == [Path(path)] * 2
    same_model(first.model, again.model)
    # written again, whole
    load_checkpoint(path, CPU)
    assert gguf_reads == [Path(path)] * 2


def test_disabled_or_unwritable_cache_loads_from_the_gguf(gguf_files, cache, gguf_reads, monkeypatch):
    path = str(gguf_files["q4"])
    monkeypatch.setenv("VERISPEC_LAYOUT_CACHE", "0")
    load_checkpoint(path, CPU)
    load_checkpoint(path, CPU)
    assert not cache.exists() and len(gguf_reads) == 2
    cache.write_text("a file where the folder should be")
    monkeypatch.setenv("VERISPEC_LAYOUT_CACHE", str(cache))
    load_checkpoint(path, CPU)
    assert len(gguf_reads) == 3 and not list(cache.parent.glob("layouts/*"))


def test_prune_drops_entries_of_gone_files_then_the_least_recently_used(
    gguf_files, cache, tmp_path, monkeypatch
):
    copies = [tmp_path / f"m{i}.gguf" for i in range(3)]
    for i, c in enumerate(copies):
        c.write_bytes(gguf_files["q4"].read_bytes())
        load_checkpoint(str(c), CPU)
        # the index's time is when it was last used
        os.utime(next(p for p in cache.glob("*.json") if str(c) in p.read_text()), (1000 + i, 1000 + i))
    assert len(list(cache.glob("*.json"))) == 3
    copies[1].unlink()
    stem = next(cache.glob("*.bin")).with_suffix("")
    size = sum(stem.with_suffix(s).stat().st_size for s in (".bin", ".safetensors", ".json"))
    monkeypatch.setenv("VERISPEC_LAYOUT_CACHE_GB", str(1.5 * size / 1e9))
    # and two unfinished writes: an hour old, and current (another process's)
    old, current = cache / "x.bin.1.tmp", cache / "y.bin.2.tmp"
    for p in (old, current):
        p.write_bytes(b"partial")
    os.utime(old, (0, 0))
    layout_cache.prune(cache)
    left = [p.read_text() for p in cache.glob("*.json")]
    assert len(left) == 1 and str(copies[2]) in left[0]
    assert sorted(p.suffix for p in cache.iterdir()) == [".bin", ".json", ".safetensors", ".tmp"]
    assert current.exists()
