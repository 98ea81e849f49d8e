"""Training data in shards (verispec/train/data.py): shards round-trip, an interrupted collection resumes to the
same files, self-instructed requests are the target's own user turns."""

from __future__ import annotations

import pytest
import torch

from verispec import LLM
from verispec.train import data
from verispec.train.data import Sample

AUX = (2, 1, 0)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    return LLM(tiny_llama, max_model_len=256, max_num_seqs=4)


@pytest.fixture
def curated() -> list[list[dict]]:
    words = ("one two", "three four five", "six", "seven eight", "nine ten eleven twelve")
    return [[{"role": "user", "content": w}] for w in words]


def test_shards_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(torch.randint(0, 300, (n,)), torch.randn(n, 3 * 8, generator=g), torch.randint(0, 300, (n,)))
        for n in (5, 9, 1)
    ]
    assert data.write_shard(tmp_path / "shard_00000.safetensors", samples) == (3, 15)
    manifest = {"shards": [{"file": "shard_00000.safetensors", "positions": 15}]}
    (tmp_path / data.MANIFEST).write_text(__import__("json").dumps(manifest))
    back = data.load_samples(tmp_path)
    assert len(back) == 3
    for a, b in zip(samples, back):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
        # aux is kept in bfloat16
        assert b.aux.dtype == torch.bfloat16 and torch.equal(a.aux.to(torch.bfloat16), b.aux)


def test_load_samples_without_a_manifest_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="no manifest.json: collect data first"):
        data.load_samples(tmp_path)


def test_an_interrupted_collection_resumes_to_the_same_shards(tiny_llm, curated, tmp_path):
    once, twice = tmp_path / "once", tmp_path / "twice"
    kw = dict(shard_size=2, max_tokens=12, log=lambda m: None)
    # the five curated conversations make three shards
    full = data.collect_shards(tiny_llm, "tiny", once, 1, curated, AUX, **kw)
    assert len(full["shards"]) == 1
    full = data.collect_shards(tiny_llm, "tiny", once, full["positions"] + 1, curated, AUX, **kw)
    full = data.collect_shards(tiny_llm, "tiny", once, full["positions"] + 1, curated, AUX, **kw)
    assert [s["sequences"] for s in full["shards"]] == [2, 2, 1]
    assert [s["source"] for s in full["shards"]] == ["curated"] * 3
    part = data.collect_shards(tiny_llm, "tiny", twice, 1, curated, AUX, **kw)
    # a stale temporary file of a killed write is overwritten
    (twice / "shard_00001.safetensors.tmp").write_bytes(b"partial")
    part = data.collect_shards(tiny_llm, "tiny", twice, full["positions"], curated, AUX, **kw)
    assert part == full
    for entry in full["shards"]:
        assert (once / entry["file"]).read_bytes() == (twice / entry["file"]).read_bytes()
    samples = data.load_samples(twice)
    assert sum(len(s.tokens) for s in samples) == full["positions"]
    # each shard's states are the target's: labels are its greedy picks on the answer
    assert all(s.labels.dtype == torch.long and len(s.labels) == len(s.tokens) for s in samples)


def test_collection_refuses_another_models_folder(tiny_llm, curated, tmp_path):
    data.collect_shards(
        tiny_llm, "tiny", tmp_path, 1, curated, AUX, shard_size=2, max_tokens=4, log=lambda m: None
    )
    with pytest.raises(ValueError, match="holds data for model='tiny', not 'other'"):
        data.collect_shards(tiny_llm, "other", tmp_path, 10**6, curated, AUX, log=lambda m: None)


def test_a_target_that_writes_no_request_is_a_clear_error(tiny_llm, monkeypatch, tmp_path):
    monkeypatch.setattr(data, "self_instruct_queries", lambda *a, **k: [])
    with pytest.raises(ValueError, match="wrote no complete user request"):
        data.collect_shards(tiny_llm, "tiny", tmp_path, 10, [], AUX, log=lambda m: None)


def test_self_instructed_requests_are_the_targets_user_turns(smollm2_gguf_path):
    llm = LLM(smollm2_gguf_path, max_model_len=512, max_num_seqs=4)
    queries = data.self_instruct_queries(llm, 4, seed=1, max_tokens=64)
    assert queries and len(set(queries)) == len(queries)
    for q in queries:
        assert len(q) >= 16 and "<|im_start|>" not in q and "<|im_end|>" not in q
    # the same seed writes the same requests
    assert data.self_instruct_queries(llm, 4, seed=1, max_tokens=64) == queries


def test_a_corrupt_shard_is_a_clear_error(tmp_path):
    (tmp_path / "shard_00000.safetensors").write_bytes(b"not a shard")
    manifest = {"shards": [{"file": "shard_00000.safetensors", "positions": 3}]}
    (tmp_path / data.MANIFEST).write_text(__import__("json").dumps(manifest))
    with pytest.raises(ValueError, match="shard_00000.safetensors: missing or corrupt shard"):
        data.load_samples(tmp_path)
