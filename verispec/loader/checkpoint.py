"""Resolve a model argument (HF folder, .gguf file or built-in alias) into a ready DecoderLM + tokenizer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from verispec.config import ModelConfig, model_config_from_hf
from verispec.distributed.group import TPGroup
from verispec.distributed.shard import Shard, check_divisible
from verispec.kernels import build
from verispec.kernels.arena import move_weights_to_huge_pages
from verispec.kernels.qweight import QuantWeight, kernels_available
from verispec.layers.linear import keep_file_layouts, keeps_quantized
from verispec.layers.linear import use_int8_activations as convert
from verispec.layers.rotary import rope_inv_freq
from verispec.loader import layout_cache
from verispec.loader.aliases import ALIASES, resolve_alias
from verispec.loader.gguf import load_gguf, load_gguf_tensor
from verispec.loader.hf import load_hf_tensors, read_hf_config, read_json, safetensors_files
from verispec.loader.weights import load_decoder_weights
from verispec.models.decoder import DecoderLM
from verispec.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m-instruct"
ACTIVATION_DTYPES = ("float32", "int8")


@dataclass
class Checkpoint:
    config: ModelConfig
    hf_config: dict
    model: DecoderLM
    # verispec.tokenizer.Tokenizer
    tokenizer: object | None
    eos_token_ids: tuple[int, ...]
    source: str


def resolve_model_path(model: str) -> Path:
    if model in ALIASES:
        return resolve_alias(model)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {model!r} not found: pass an HF checkpoint folder, a .gguf file, or one of: {', '.join(ALIASES)}"
        )
    return path


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a model name, .gguf file or HF folder, without reading its weights."""
    path = resolve_model_path(model)
    if path.is_file():
        return load_gguf(path, with_tensors=False).tokenizer
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{model}: no tokenizer.json in the folder")
    return Tokenizer.from_hf_dir(path)


def pick_dtype(dtype: str | torch.dtype, device: torch.device, hf_config: dict) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "float": torch.float32,
        "float16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
    }
    if dtype == "auto":
        if device.type == "cpu":
            # no fast bf16 on this class of CPU
            return torch.float32
        want = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16")
        return names.get(want, torch.bfloat16) if want != "float32" else torch.bfloat16
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: auto, {', '.join(names)}")
    return names[dtype]


def load_checkpoint(
    model: str,
    device: torch.device,
    dtype: str | torch.dtype = "auto",
    tokenizer: str | None = None,
    skip_tokenizer_init: bool = False,
    keep_quantized: bool = True,
    activation_dtype: str = "float32",
    tp: TPGroup | None = None,
) -> Checkpoint:
    """activation_dtype: "float32" (the default: transformers' float32 numerics on the same weights) or "int8"
    (activations quantized per row in 32-blocks, integer dot products: llama.cpp's numerics, faster; needs GGUF
    weights kept quantized on the CPU and the native kernels, else ValueError). tp: this process's tensor-parallel
    rank, which loads its shard of the layers (the Checkpoint's config stays the whole model's)."""
    if activation_dtype not in ACTIVATION_DTYPES:
        allowed = ", ".join(ACTIVATION_DTYPES)
        raise ValueError(f"activation_dtype={activation_dtype!r} is not supported; allowed: {allowed}")
    path = resolve_model_path(model)
    tok, cached, cache_key = None, None, None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: not a .gguf file or HF folder (pickle checkpoints are never loaded)")

        # On the CPU in float32, quantized projections stay in their blocks for the native kernels.
        keep = keep_quantized and device.type == "cpu" and dtype in ("auto", "float32", torch.float32)
        keep = keep and kernels_available()
        if keep:
            shard_id = None if tp is None else (tp.rank, tp.size)
            cache_key = layout_cache.entry_key(path, activation_dtype, shard_id)
            cached = layout_cache.find(layout_cache.cache_root(), cache_key)
        gguf = load_gguf(path, keep_quantized=keep, with_tensors=cached is None)
        hf_config, tensors, tok, eos = gguf.hf_config, gguf.tensors, gguf.tokenizer, list(gguf.eos_token_ids)
        del gguf
    else:
        hf_config = read_hf_config(path)
        # unsupported architecture: fail before reading weights
        model_config_from_hf(hf_config, str(path))
        tensors = load_hf_tensors(path)
        eos = _eos_ids(path, hf_config)
        if not skip_tokenizer_init and tokenizer is None and (path / "tokenizer.json").is_file():
            tok = Tokenizer.from_hf_dir(path)
    if tokenizer is not None and not skip_tokenizer_init:
        tok = Tokenizer.from_hf_dir(Path(tokenizer))
    if skip_tokenizer_init:
        tok = None
    if tok is not None:
        eos = sorted(set(eos) | set(tok.eos_token_ids))
    cfg = model_config_from_hf(hf_config, str(path))
    dt = pick_dtype(dtype, device, hf_config)
    shard = None
    if tp is not None:
        check_divisible(cfg, tp.size)
        shard = Shard(cfg, tp.rank, tp.size)
    net = _build(cfg, shard, tp, device, dt)
    if cached is not None and not layout_cache.restore(cached, net):
        # a damaged entry (now deleted): load from the GGUF after all
        net, cached = _build(cfg, shard, tp, device, dt), None
        tensors = load_gguf(path, keep_quantized=True).tensors
    if cached is None:
        if activation_dtype == "int8":
            keep_file_layouts(net)
        load_decoder_weights(net, tensors, str(path), shard)
        # the layers hold what they keep: the checkpoint's copies go before the huge-page copy
        del tensors
        if activation_dtype == "int8":
            use_int8_activations(net, str(path))
        # the weights written to the layout cache, then mapped from it (no copy onto huge pages), as a later load
        saved = layout_cache.save(layout_cache.cache_root(), cache_key, net, path)
        if saved is None or not layout_cache.restore(saved, net):
            move_weights_to_huge_pages(net)
    fuse_if_enabled(net)
    net.eval()
    return Checkpoint(cfg, hf_config, net, tok, tuple(eos), str(path))


def _build(
    cfg: ModelConfig, shard: Shard | None, tp: TPGroup | None, device: torch.device, dtype: torch.dtype
) -> DecoderLM:
    """The model (this rank's shard of it) with uninitialized tensors on `device`, RoPE tables filled."""
    with torch.device("meta"):
        net = DecoderLM(cfg) if shard is None else DecoderLM(shard.local_config(), tp, shard.vocab_sizes)
    materialize(net, device, dtype)
    _init_rope(net, cfg)
    return net


def materialize(net: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give a module built on the meta device uninitialized storage on `device`: floating tensors in `dtype`, the
    others in their own (torch's to_empty does the same, but its meta path imports torch.fx's symbolic shapes: half
    a second of every start-up)."""
    for m in net.modules():
        for store in (m._parameters, m._buffers):
            for name, t in store.items():
                if t is None or not t.is_meta:
                    continue
                dt = dtype if t.is_floating_point() else t.dtype
                new = torch.empty(t.shape, dtype=dt, device=device)
                store[name] = (
                    torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
                )


def read_lm_head(source: str, tied: bool, keep_quantized: bool = True) -> torch.Tensor | QuantWeight:
    """The whole LM head's weight read again from the target checkpoint at `source` (the embedding's, when tied):
    for a tensor-parallel rank 0 whose drafter uses the target's head, which the ranks hold in shards."""
    names = ("embed_tokens.weight",) if tied else ("lm_head.weight",)
    path = Path(source)
    if path.is_file():
        keep = keep_quantized and kernels_available()
        return load_gguf_tensor(
            path, tuple(f"model.{n}" if n.startswith("embed") else n for n in names), keep
        )
    for f in safetensors_files(path):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open has no __contains__)
                if key.removeprefix("model.language_model.").removeprefix("model.") in names:
                    return st.get_tensor(key)
    raise ValueError(f"{source}: no tensor {names[0]}")


def fuse_if_enabled(net: DecoderLM) -> None:
    """Run `net`'s layers through one C call where they allow it (CPU, quantized projections), unless
    VERISPEC_FUSED_LAYERS=0; again after its weights change (a draft that follows its target's)."""
    if net.embed_tokens.weight.is_cpu and os.environ.get("VERISPEC_FUSED_LAYERS", "1") != "0":
        net.fuse_layers()


def use_int8_activations(net: DecoderLM, source: str) -> None:
    """Switch every quantized projection of `net` (the LM head included) to int8 activations, or raise ValueError
    saying why it cannot be (no int8 kernel for this CPU, or no weight kept quantized)."""

    if not net.embed_tokens.weight.is_cpu:
        raise ValueError(
            f"activation_dtype='int8' runs on the CPU only (x86 integer kernels); the model is on "
            f"{net.embed_tokens.weight.device.type}: use device='cpu' or activation_dtype='float32'"
        )
    if not kernels_available() or build.int8_isa() is None:
        raise ValueError(
            "activation_dtype='int8' needs the native kernels (x86-64 with AVX2 and FMA, a C compiler, "
            "VERISPEC_KERNELS not 0); this machine has none: use activation_dtype='float32'"
        )
    if not keeps_quantized(net):
        raise ValueError(
            "activation_dtype='int8' needs GGUF weights kept quantized (Q4_0, Q4_1, Q4_K, Q5_0, Q8_0 or Q6_K, on the "
            f"CPU in float32, keep_quantized=True); {source} has none: use activation_dtype='float32'"
        )
    convert(net)


def _init_rope(net: DecoderLM, cfg: ModelConfig) -> None:

    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    net.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling).to(net.embed_tokens.weight.device)
    local = cfg.rope_local_theta or cfg.rope_theta
    net.inv_freq_local = rope_inv_freq(cfg.head_dim, local).to(net.embed_tokens.weight.device)


def _eos_ids(folder: Path, hf_config: dict) -> list[int]:
    ids: list[int] = []
    for src in (
        hf_config,
        read_json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else {},
    ):
        e = src.get("eos_token_id")
        ids += e if isinstance(e, list) else ([e] if e is not None else [])
    return sorted(set(ids))
