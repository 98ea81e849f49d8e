"""Shipped drafts (verispec/drafts): found by target and method, only where the folder exists."""

from __future__ import annotations

import json

import pytest

from verispec import drafts
from verispec.proposers.factory import resolve_speculative_config


@pytest.fixture
def fake_shipped(tmp_path, monkeypatch):
    """A shipped EAGLE-3 folder for the alias 'smollm2-135m-instruct', written in a temp dir."""
    folder = tmp_path / "eagle3-draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    monkeypatch.setattr(drafts, "SHIPPED", {("smollm2-135m-instruct", "eagle3"): str(folder)})
    return folder


def test_a_shipped_draft_is_found_by_target_and_method(fake_shipped):
    assert drafts.shipped_draft("smollm2-135m-instruct", "eagle3") == str(fake_shipped)
    assert drafts.shipped_draft("smollm2-135m-instruct", "eagle") is None
    assert drafts.shipped_draft("some/other/model", "eagle3") is None
    assert drafts.shipped_draft(None, "eagle3") is None


def test_a_missing_folder_is_not_shipped(fake_shipped):
    (fake_shipped / "config.json").unlink()
    assert drafts.shipped_draft("smollm2-135m-instruct", "eagle3") is None


def test_the_config_without_model_takes_the_shipped_draft_and_an_explicit_model_wins(fake_shipped, tmp_path):
    sc = {"method": "eagle3", "num_speculative_tokens": 3}
    spec = resolve_speculative_config(sc, 2048, target_model="smollm2-135m-instruct")
    assert spec.model == str(fake_shipped)
    # other targets keep vLLM's error
    with pytest.raises(ValueError, match="requires `model`"):
        resolve_speculative_config(sc, 2048, target_model="other")
    other = tmp_path / "mine"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    spec = resolve_speculative_config({**sc, "model": str(other)}, 2048, target_model="smollm2-135m-instruct")
    assert spec.model == str(other)
