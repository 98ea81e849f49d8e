"""kernels/fused_layers: the decoder layers run by one C call give bitwise the module path's results.

On the real SmolLM2 GGUF (Q4_1 + Q8_0 weights, the model the fused path exists for): a ragged prefill (packed
tokens), decode steps, a multi-token chunk after a truncation, a token tree, an idle slot inside the slot range,
ragged verification rows and hidden-state capture, each run fused and unfused.
"""

from __future__ import annotations

import pytest
import torch

from verispec.kernels.fused_layers import why_not_fusable
from verispec.loader.checkpoint import load_checkpoint
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner, RowInput

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smol_model(smollm2_gguf_path):
    ck = load_checkpoint(smollm2_gguf_path, CPU, skip_tokenizer_init=True)
    if ck.model.fused is None:
        pytest.skip(f"fused layers do not apply here: {why_not_fusable(ck.model)}")
    return ck


def _script(ck, fused: bool) -> tuple[list, int]:
    """Run a fixed sequence of steps; return every output tensor and how many steps ran fused."""
    model = ck.model
    keep = model.fused
    calls = 0
    if fused:
        run = keep.run

        def counting(*a, **k):
            nonlocal calls
            calls += 1
            return run(*a, **k)

        keep.run = counting
    else:
        model.fused = None
    try:
        runner = ModelRunner(model, KVCache(ck.config, 4, 96, CPU, torch.float32), CPU)
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, 49152, (3, 40), generator=g).tolist()
        outs = []
        prefill = [RowInput(0, 0, ids[0][:11]), RowInput(2, 0, ids[1][:23]), RowInput(1, 0, ids[2][:5])]
        # mixed lengths: packed tokens, attention padded
        outs.append(runner.run(prefill, aux_layers=(1, 15)))
        lens = [11, 23, 5]
        # decode steps, three rows of different context lengths
        for step in range(3):
            rows = [
                RowInput(s, n + step, [ids[i][n + step]]) for i, (s, n) in enumerate(zip((0, 2, 1), lens))
            ]
            outs.append(runner.run(rows, aux_layers=(0, 7, 29)))
        # roll row 0 back to 6 tokens and score 4-token chunks in all rows (speculative verification)
        chunk = [RowInput(0, 6, ids[0][6:10]), RowInput(2, 26, ids[1][26:30]), RowInput(1, 8, ids[2][8:12])]
        outs.append(runner.run(chunk, aux_layers=(2,)))
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        outs.append(runner.run([RowInput(0, 10, ids[0][10:14], tree_mask=tree, depths=[0, 1, 1, 2])]))
        # a hole in the slot range (slot 1 idle): one padding row, still fused
        outs.append(runner.run([RowInput(0, 14, ids[0][14:15]), RowInput(2, 30, ids[1][30:31])]))
        # ragged verification: 2, 5 and 1 tokens scored after different contexts (packed tokens, padded attention)
        ragged = [
            RowInput(0, 15, ids[0][15:17]),
            RowInput(1, 12, ids[2][12:17]),
            RowInput(2, 31, ids[1][31:32]),
        ]
        outs.append(runner.run(ragged, aux_layers=(3,)))
    finally:
        model.fused = keep
        if fused:
            keep.run = run
    flat = [t for o in outs for t in (o.logits, o.hidden, o.aux_hidden) if t is not None]
    return flat, calls


def test_fused_layers_equal_module_path_bitwise(smol_model):
    fused, calls = _script(smol_model, True)
    plain, none = _script(smol_model, False)
    # one call per forward, aux layers or not: prefill, 3 decode steps, chunk, tree, idle slot, ragged
    assert none == 0 and calls == 8
    assert len(fused) == len(plain)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


def test_models_that_do_not_qualify_say_why(tiny_checkpoints):
    for arch, reason in (("llama", "a projection is not quantized"), ("gemma3", "not a plain Llama block")):
        ck = load_checkpoint(tiny_checkpoints[arch], CPU, skip_tokenizer_init=True)
        assert ck.model.fused is None
        assert why_not_fusable(ck.model) in (reason, "no kernels")
