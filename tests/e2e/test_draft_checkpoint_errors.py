"""Bad draft checkpoints and speculative settings fail at construction with a ValueError naming the problem, never
inside generate() (found by a robustness sweep)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import (
    write_tiny_dflash,
    write_tiny_eagle,
    write_tiny_eagle3,
    write_tiny_medusa,
    write_tiny_mlp_speculator,
)
from verispec import LLM


def _edit(folder: Path, config=None, tensors=None) -> str:
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config(cfg)))
    if tensors:
        save_file(tensors(load_file(str(folder / "model.safetensors"))), str(folder / "model.safetensors"))
    return str(folder)


def _fails(target: str, spec: dict, match: str, **kw) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(target, max_model_len=128, speculative_config=spec, **kw)


def test_token_tree_limits(tiny_llama, tiny_eagle):
    eagle = {"method": "eagle", "model": tiny_eagle, "num_speculative_tokens": 2}
    _fails(
        tiny_llama,
        {**eagle, "speculative_token_tree": "[(0,), (400,)]"},
        "child rank 400 .* the drafter has 320",
    )
    _fails(
        tiny_llama,
        {**eagle, "speculative_token_tree": "[(0,), (1,), (0, 0), (0, 0, 0)]"},
        "3 levels deep but num_speculative_tokens is 2",
    )
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "speculative_token_tree": "[(0,), (0, 0), (0, 0, 0)]",
    }
    _fails(tiny_llama, ngram, "3 levels deep")


def test_eagle3_checkpoint_values(tiny_llama, tmp_path):
    def e3(name, **kw):
        return write_tiny_eagle3(tmp_path / name, Path(tiny_llama), **kw)

    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    bad_d2t = _edit(e3("a", draft_vocab=64), tensors=lambda w: {**w, "d2t": torch.full((64,), 300)})
    _fails(tiny_llama, {**spec, "model": bad_d2t}, "'d2t' maps to token ids outside")
    float_d2t = _edit(e3("b", draft_vocab=64), tensors=lambda w: {**w, "d2t": torch.zeros(64)})
    _fails(tiny_llama, {**spec, "model": float_d2t}, "'d2t' must be 64 integer token ids")
    big = _edit(e3("c"), config=lambda c: {**c, "draft_vocab_size": 400})
    _fails(tiny_llama, {**spec, "model": big}, "draft_vocab_size=400 exceeds vocab_size=320")
    word = _edit(e3("d"), config=lambda c: {**c, "target_hidden_size": "x"})
    _fails(tiny_llama, {**spec, "model": word}, "'target_hidden_size' must be an integer")
    ids = _edit(e3("e"), config=lambda c: {**c, "eagle_aux_hidden_state_layer_ids": [True, 0, 1]})
    _fails(tiny_llama, {**spec, "model": ids}, "must be a list of layer indices")
    nested = _edit(e3("f"), config=lambda c: {**c, "eagle_config": [1]})
    _fails(tiny_llama, {**spec, "model": nested}, "eagle_config must be an object")
    embed = _edit(e3("g"), tensors=lambda w: {**w, "embed_tokens.weight": torch.zeros(10, 64)})
    _fails(tiny_llama, {**spec, "model": embed}, "'embed_tokens.weight' has shape")


def test_counts_are_checked_against_the_weights_before_allocating(tiny_llama, tmp_path):
    medusa = _edit(
        write_tiny_medusa(tmp_path / "m", Path(tiny_llama)), config=lambda c: {**c, "medusa_num_heads": 10**9}
    )
    _fails(
        tiny_llama,
        {"method": "medusa", "model": medusa, "num_speculative_tokens": 2},
        "says 1000000000 heads",
    )
    mlp = _edit(
        write_tiny_mlp_speculator(tmp_path / "s", Path(tiny_llama)),
        config=lambda c: {**c, "n_predict": 10**9},
    )
    _fails(tiny_llama, {"model": mlp, "num_speculative_tokens": 2}, "says n_predict=1000000000")
    eagle = write_tiny_eagle(tmp_path / "e", Path(tiny_llama))
    spec = {"method": "eagle", "model": str(eagle), "num_speculative_tokens": 2}
    _edit(eagle, config=lambda c: {**c, "num_hidden_layers": 10**6})
    _fails(tiny_llama, spec, "says 1000000 layers")
    _edit(eagle, config=lambda c: {**c, "num_hidden_layers": 0})
    _fails(tiny_llama, spec, "'num_hidden_layers' must be an integer >= 1, got 0")


def test_medusa_config_values(tiny_llama, tmp_path):
    spec = {"method": "medusa", "num_speculative_tokens": 2}
    scale = _edit(
        write_tiny_medusa(tmp_path / "a", Path(tiny_llama)), config=lambda c: {**c, "logit_scale": None}
    )
    _fails(tiny_llama, {**spec, "model": scale}, "logit_scale must be a number > 0, got None")
    trunc = _edit(
        write_tiny_medusa(tmp_path / "b", Path(tiny_llama)),
        config=lambda c: {**c, "truncated_vocab_size": 400},
    )
    _fails(tiny_llama, {**spec, "model": trunc}, "truncated_vocab_size must be an integer in")
    folder = write_tiny_medusa(tmp_path / "c", Path(tiny_llama), num_heads=2)

    def truncated(w):
        w = {k: (v[:4].contiguous() if "lm_heads" in k else v) for k, v in w.items()}
        return {**w, "token_map": torch.tensor([1, 2, 3, 999])}

    bad_map = _edit(folder, config=lambda c: {**c, "truncated_vocab_size": 4}, tensors=truncated)
    _fails(tiny_llama, {**spec, "model": bad_map}, "'token_map' maps to token ids outside")


def test_extract_hidden_states_settings(tiny_llama, tmp_path):
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1}
    ok = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    _fails(
        tiny_llama,
        spec,
        "not a writable folder",
        kv_transfer_config={**ok, "kv_connector_extra_config": {"shared_storage_path": "/proc"}},
    )
    _fails(
        tiny_llama,
        spec,
        r"unknown key\(s\) \['foo'\]",
        kv_transfer_config={
            **ok,
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path), "foo": 1},
        },
    )
    _fails(
        tiny_llama,
        {**spec, "model": tiny_llama},
        "reads the target itself; omit model",
        kv_transfer_config=ok,
    )
    _fails(tiny_llama, spec, "kv_transfer_config is not valid JSON", kv_transfer_config="{bad")


def test_pard_token_null_falls_through_to_ptd_token_id(tiny_llama, tiny_draft, tmp_path):
    import shutil

    folder = tmp_path / "pard"
    shutil.copytree(tiny_draft, folder)
    _edit(folder, config=lambda c: {**c, "pard_token": None, "ptd_token_id": 7})
    spec = {
        "method": "draft_model",
        "model": str(folder),
        "num_speculative_tokens": 2,
        "parallel_drafting": True,
    }
    assert LLM(tiny_llama, max_model_len=128, speculative_config=spec).engine.proposer.mask_token == 7


def test_a_file_is_not_a_draft_folder(tiny_llama, tiny_eagle):
    spec = {"method": "eagle", "model": str(Path(tiny_eagle) / "config.json"), "num_speculative_tokens": 2}
    _fails(tiny_llama, spec, "a file, not a model folder")


def test_dflash_settings(tiny_llama, tmp_path):
    """DFlash: the block size bounds num_speculative_tokens; the mask token, the target layers and the sizes must fit
    the target; the layer count is checked against the weights before allocating."""

    def dflash(name, **kw):
        return str(write_tiny_dflash(tmp_path / name, Path(tiny_llama), **kw))

    spec = {"method": "dflash", "num_speculative_tokens": 2}
    _fails(
        tiny_llama,
        {**spec, "model": dflash("a", block_size=4), "num_speculative_tokens": 4},
        r"num_speculative_tokens=4 but .* drafts blocks of block_size=4 \(the newest token and 3 mask tokens\): "
        "use at most 3",
    )
    no_mask = _edit(Path(dflash("b")), config=lambda c: {**c, "dflash_config": {"target_layer_ids": [0, 2]}})
    _fails(
        tiny_llama,
        {**spec, "model": str(no_mask)},
        r"`dflash_config.mask_token_id`, `mask_token_id`, `dspark_noise_token_id`, `pard_token`, or `ptd_token_id`",
    )
    _fails(
        tiny_llama,
        {**spec, "model": dflash("c", mask_token_id=320)},
        r"mask token 320 must be a token id in \[0, 320\)",
    )
    _fails(
        tiny_llama,
        {**spec, "model": dflash("d", target_layer_ids=[0, 3])},
        r"dflash_config.target_layer_ids \[0, 3\] must be increasing ids in 0..2: the target has 3 layers",
    )
    vocab = _edit(Path(dflash("e")), config=lambda c: {**c, "vocab_size": 400})
    _fails(tiny_llama, {**spec, "model": str(vocab)}, "DFlash vocab_size=400 but the target's is 320")
    layers = _edit(Path(dflash("f")), config=lambda c: {**c, "num_hidden_layers": 10**6})
    _fails(tiny_llama, {**spec, "model": str(layers)}, "says 1000000 layers")
    tree = {**spec, "model": dflash("g"), "speculative_token_tree": "[(0,), (1,), (0, 0)]"}
    _fails(tiny_llama, tree, "tree drafting is supported with methods eagle, eagle3, mtp, not 'dflash'")
    # the block size may sit in dflash_config
    nested = _edit(
        Path(dflash("h", block_size=16)),
        config=lambda c: {**c, "dflash_config": {**c["dflash_config"], "block_size": 3}},
    )
    _fails(
        tiny_llama,
        {**spec, "model": str(nested), "num_speculative_tokens": 3},
        "block_size=3 .* use at most 2",
    )
