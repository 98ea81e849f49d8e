"""The one weight loader (verispec/loader/weights.py): separate checkpoint weights into fused layers' rows, errors
naming the tensor, quantized shards fused into one QuantWeight."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from verispec.kernels.qweight import QuantWeight, kernels_available
from verispec.layers.linear import Dense
from verispec.layers.norm import RMSNorm
from verispec.loader.weights import load_weights
from verispec.models.decoder import PACKED_MODULES

H, Q, KV, INTER = 64, 32, 16, 32


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = Dense(H, Q + 2 * KV, bias=True, shards={"q": Q, "k": KV, "v": KV})


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = Dense(H, 2 * INTER, shards={0: INTER, 1: INTER})
        self.down_proj = Dense(INTER, H)


class Block(nn.Module):
    """A decoder block's fused layers, a norm and a plain nn.Linear: what the models load."""

    packed_modules_mapping = PACKED_MODULES

    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp, self.norm = Attn(), MLP(), RMSNorm(H, 1e-6)
        self.fc = nn.Linear(2 * H, H)


@pytest.fixture
def checkpoint() -> dict[str, torch.Tensor]:
    """Block's weights as a checkpoint stores them: q/k/v and gate/up separate, plus a tensor nothing reads."""
    g = torch.Generator().manual_seed(0)
    shapes = {
        "self_attn.q_proj.weight": (Q, H),
        "self_attn.k_proj.weight": (KV, H),
        "self_attn.v_proj.weight": (KV, H),
        "self_attn.q_proj.bias": (Q,),
        "self_attn.k_proj.bias": (KV,),
        "self_attn.v_proj.bias": (KV,),
        "mlp.gate_proj.weight": (INTER, H),
        "mlp.up_proj.weight": (INTER, H),
        "mlp.down_proj.weight": (H, INTER),
        "norm.weight": (H,),
        "fc.weight": (H, 2 * H),
        "fc.bias": (H,),
        "embed_tokens.weight": (10, H),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def q8(w: torch.Tensor) -> QuantWeight:
    return QuantWeight.quantize_q8(w)


def q4_1(w: torch.Tensor) -> QuantWeight:
    raw = quantize(w.numpy().astype(np.float32), GGMLQuantizationType.Q4_1)
    return QuantWeight.from_gguf(raw, "Q4_1", tuple(w.shape))


def qkv_of(parts: dict[str, torch.Tensor | QuantWeight]) -> torch.Tensor:
    """The fused q/k/v rows the loader should build from `parts` (quantized parts as the values they hold)."""
    dense = [p.dequantize() if isinstance(p, QuantWeight) else p for p in parts.values()]
    return torch.cat(dense)


def qkv_parts(ckpt: dict) -> dict[str, torch.Tensor]:
    return {n: ckpt[f"self_attn.{n}_proj.weight"] for n in "qkv"}


def test_separate_weights_load_into_their_rows(checkpoint):
    block = Block()
    load_weights(block, checkpoint, "ckpt", "toy")
    at, mlp = block.self_attn.qkv_proj, block.mlp.gate_up_proj
    assert torch.equal(at.weight, torch.cat([checkpoint[f"self_attn.{n}_proj.weight"] for n in "qkv"]))
    assert torch.equal(at.bias, torch.cat([checkpoint[f"self_attn.{n}_proj.bias"] for n in "qkv"]))
    assert torch.equal(
        mlp.weight, torch.cat([checkpoint["mlp.gate_proj.weight"], checkpoint["mlp.up_proj.weight"]])
    )
    assert torch.equal(block.mlp.down_proj.weight, checkpoint["mlp.down_proj.weight"])
    assert torch.equal(block.norm.weight, checkpoint["norm.weight"])
    assert torch.equal(block.fc.bias, checkpoint["fc.bias"])
    x = torch.randn(3, H)
    torch.testing.assert_close(at(x), x @ at.weight.T + at.bias)


@pytest.mark.parametrize(
    ("what", "message"),
    [
        # a draft head
        ("toy", "ckpt: toy weight 'self_attn.k_proj.bias' is missing"),
        # a target model
        ("", "ckpt: checkpoint is missing tensor 'self_attn.k_proj.bias'"),
    ],
)
def test_a_missing_shard_is_named(checkpoint, what, message):
    del checkpoint["self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_weights(Block(), checkpoint, "ckpt", what)


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("self_attn.v_proj.weight", (KV + 1, H), (KV, H)),
        ("self_attn.q_proj.bias", (KV,), (Q,)),
        ("mlp.up_proj.weight", (INTER, H + 1), (INTER, H)),
        ("norm.weight", (H + 1,), (H,)),
        ("fc.weight", (H, H), (H, 2 * H)),
    ],
)
def test_a_misshapen_tensor_is_named(checkpoint, name, shape, expected):
    checkpoint[name] = torch.zeros(shape)
    message = f"ckpt: toy weight '{name}' has shape {shape}, expected {expected}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_weights(Block(), checkpoint, "ckpt", "toy")


def test_a_misshapen_quantized_shard_is_named(checkpoint):
    checkpoint["self_attn.k_proj.weight"] = q8(torch.randn(2 * KV, H))
    with pytest.raises(
        ValueError, match=r"'self_attn.k_proj.weight' has shape \(32, 64\), expected \(16, 64\)"
    ):
        load_weights(Block(), checkpoint, "ckpt", "toy")


@pytest.mark.skipif(
    not kernels_available(), reason="no AVX2/FMA CPU or no C compiler: nothing stays quantized"
)
def test_quantized_shards_fuse_into_one_quant_weight(checkpoint):
    parts = {n: q8(w) for n, w in qkv_parts(checkpoint).items()}
    checkpoint.update({f"self_attn.{n}_proj.weight": p for n, p in parts.items()})
    checkpoint["mlp.down_proj.weight"] = q4_1(checkpoint["mlp.down_proj.weight"])
    block = Block()
    load_weights(block, checkpoint, "ckpt", "toy")
    at = block.self_attn.qkv_proj
    assert at.qweight is not None and at.qweight.shape == (Q + 2 * KV, H) and at.weight.numel() == 0
    assert torch.equal(at.qweight.dequantize(), qkv_of(parts))
    assert block.mlp.down_proj.qweight is not None
    assert torch.equal(
        block.mlp.down_proj.qweight.dequantize(), checkpoint["mlp.down_proj.weight"].dequantize()
    )
    x = torch.randn(3, H)
    torch.testing.assert_close(at(x), x @ qkv_of(parts).T + at.bias, atol=1e-4, rtol=1e-4)


def test_shards_in_different_formats_stay_quantized_apart(checkpoint):
    """No one quantized weight holds q8 and q4_1 rows: each shard keeps its blocks (a Q4_K_M file's q / k / v)."""
    parts = {"q": q8, "k": q4_1, "v": q4_1}
    parts = {n: parts[n](w) for n, w in qkv_parts(checkpoint).items()}
    checkpoint.update({f"self_attn.{n}_proj.weight": p for n, p in parts.items()})
    block = Block()
    load_weights(block, checkpoint, "ckpt", "toy")
    at = block.self_attn.qkv_proj
    assert at.qweight is None and at.weight.numel() == 0
    assert [p.shape for p in at.qparts] == [parts[n].shape for n in ("q", "k", "v")]
    x = torch.randn(5, at.in_features)
    want = torch.cat([parts[n].for_kernels().matmul(x) for n in ("q", "k", "v")], 1) + at.bias
    assert torch.equal(at(x), want)


def test_a_float_shard_dequantizes_the_others_into_their_rows(checkpoint):
    parts = {"q": torch.clone, "k": q8, "v": q8}
    parts = {n: parts[n](w) for n, w in qkv_parts(checkpoint).items()}
    checkpoint.update({f"self_attn.{n}_proj.weight": p for n, p in parts.items()})
    block = Block()
    load_weights(block, checkpoint, "ckpt", "toy")
    at = block.self_attn.qkv_proj
    assert at.qweight is None and at.qparts is None and torch.equal(at.weight, qkv_of(parts))


def test_without_kernels_quantized_shards_are_dequantized(checkpoint, monkeypatch):
    monkeypatch.setattr("verispec.layers.linear.kernels_available", lambda: False)
    parts = {n: q8(w) for n, w in qkv_parts(checkpoint).items()}
    checkpoint.update({f"self_attn.{n}_proj.weight": p for n, p in parts.items()})
    block = Block()
    load_weights(block, checkpoint, "ckpt", "toy")
    at = block.self_attn.qkv_proj
    assert at.qweight is None and torch.equal(at.weight, qkv_of(parts))
