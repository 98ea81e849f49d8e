"""Logit parity with transformers on tiny random seeded checkpoints of each architecture (float32, < 1e-4)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ARCHS
from verispec.loader.checkpoint import load_checkpoint
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner, RowInput

ATOL = 1e-4


def _pair(folder: str):
    from transformers import AutoModelForCausalLM

    ck = load_checkpoint(folder, torch.device("cpu"), skip_tokenizer_init=True)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(
        ck.model, KVCache(ck.config, 4, 128, torch.device("cpu"), torch.float32), torch.device("cpu")
    )
    return runner, ref


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_chunks_after_truncation(tiny_checkpoints, arch):
    runner, ref = _pair(tiny_checkpoints[arch])
    ids = torch.randint(0, 300, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # [3, 24, V]
        want = ref(ids).logits
    # three requests of different lengths in non-adjacent slots, in one padded forward
    out = runner.run(
        [
            RowInput(0, 0, ids[0, :12].tolist()),
            RowInput(2, 0, ids[2].tolist()),
            RowInput(1, 0, ids[1, :7].tolist()),
        ]
    )
    got = out.logits.split([12, 24, 7])
    assert (got[0] - want[0, :12]).abs().max() < ATOL
    assert (got[1] - want[2]).abs().max() < ATOL
    assert (got[2] - want[1, :7]).abs().max() < ATOL
    # roll row 0 back to 8 tokens (O(1): just a new start) and score a multi-token chunk; row 1 continues
    out = runner.run([RowInput(0, 8, ids[0, 8:20].tolist()), RowInput(1, 7, ids[1, 7:11].tolist())])
    a, b = out.logits.split([12, 4])
    assert (a - want[0, 8:20]).abs().max() < ATOL
    assert (b - want[1, 7:11]).abs().max() < ATOL
    # single-token decode, logits only for the requested positions
    out = runner.run(
        [RowInput(0, 20, ids[0, 20:21].tolist()), RowInput(1, 11, ids[1, 11:14].tolist(), logits_from=2)]
    )
    assert out.logits.shape[0] == 2
    assert (out.logits[0] - want[0, 20]).abs().max() < ATOL
    assert (out.logits[1] - want[1, 13]).abs().max() < ATOL


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_hidden_states_of_requested_layers(tiny_checkpoints, arch):
    runner, ref = _pair(tiny_checkpoints[arch])
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # embeddings, then each layer's output
        want = ref(ids, output_hidden_states=True).hidden_states
    out = runner.run([RowInput(0, 0, ids[0].tolist())], aux_layers=(0, 2))
    # the two aux layers' streams side by side
    first, second = out.aux_hidden.chunk(2, dim=-1)
    assert (first - want[0][0]).abs().max() < ATOL
    assert (second - want[2][0]).abs().max() < ATOL
    # final normed state
    assert (out.hidden - want[-1][0]).abs().max() < ATOL


def test_tree_attention_matches_separate_chains(tiny_checkpoints):
    """A token tree scored in one forward equals scoring each root-to-leaf path on its own."""
    runner, ref = _pair(tiny_checkpoints["llama"])
    prefix = [5, 9, 17, 33, 65]
    # tree: root a(0) with children b(1), c(2); b has child d(3)
    toks, parents = [40, 41, 42, 43], [-1, 0, 0, 1]
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    depths = [0, 1, 1, 2]
    runner.run([RowInput(0, 0, prefix)])
    out = runner.run([RowInput(0, len(prefix), toks, tree_mask=mask, depths=depths)])
    with torch.no_grad():
        path_abd = ref(torch.tensor([prefix + [40, 41, 43]])).logits[0, -3:]
        path_ac = ref(torch.tensor([prefix + [40, 42]])).logits[0, -1]
    assert (out.logits[[0, 1, 3]] - path_abd).abs().max() < ATOL
    assert (out.logits[2] - path_ac).abs().max() < ATOL


def test_sharded_safetensors(tmp_path):
    from tests.tiny_models import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "sharded", "qwen2", seed=5, shards=2)
    assert (folder / "model.safetensors.index.json").is_file()
    runner, ref = _pair(str(folder))
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        want = ref(ids).logits[0]
    assert (runner.run([RowInput(0, 0, ids[0].tolist())]).logits - want).abs().max() < ATOL
