"""One weight loader for the target model and every draft head (nano-vllm's utils/loader.py).

Checkpoints store q/k/v and gate/up as separate weights; the models keep them fused (`qkv_proj`, `gate_up_proj`).
A model's `packed_modules_mapping` says which checkpoint module is which shard of which fused module
({"q_proj": ("qkv_proj", "q"), ...}). `load_weights` walks the model's parameters, looks each one (or each of its
shards) up in the checkpoint under the model's own name, and hands it to the owning module's
`weight_loader(param, value[, shard_id])` (a fused Dense copies a shard into its rows), or copies it whole. Modules
with a `finish_loading()` run it once everything is in (Dense: fuse quantized shards, pack for MKL). A missing or
misshapen weight fails with one ValueError naming it; checkpoint tensors no parameter reads are ignored (a draft's
copy of the target's embedding, say).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from verispec.layers.weight_loader import Tensor, default_weight_loader

if TYPE_CHECKING:
    from verispec.distributed.shard import Shard
    from verispec.models.decoder import DecoderLM

M = TypeVar("M", bound=nn.Module)


def load_weights(
    model: nn.Module, tensors: Mapping[str, Tensor], source: str | Path, what: str = "", consume: bool = False
) -> None:
    """Fill every parameter of `model` from `tensors`, keyed by the model's parameter names with packed modules
    under their checkpoint names (`layers.0.self_attn.q_proj.weight` for a shard of `...qkv_proj.weight`). A module
    finishes loading (`finish_loading`) once its last parameter is in. consume: take each tensor out of `tensors`
    (a dict) once read, so that a layer's checkpoint copy is freed as soon as the layer has its own.

    Errors name `source` and the tensor: "{source}: {what} weight 'x' is missing" for a draft head (`what`, e.g.
    "EAGLE"), "{source}: checkpoint is missing tensor 'x'" for a target model (no `what`), and
    "... 'x' has shape (a, b), expected (c, d)" for a tensor that does not fit."""
    shards_of: dict[str, list[tuple[str, str | int]]] = {}
    for checkpoint_module, (fused, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        shards_of.setdefault(fused, []).append((checkpoint_module, shard_id))
    modules = dict(model.named_modules())
    params = list(model.named_parameters())
    # the index of each module's last parameter
    last = {name.rpartition(".")[0]: j for j, (name, _) in enumerate(params)}
    for j, (name, param) in enumerate(params):
        module_name, _, leaf = name.rpartition(".")
        loader = getattr(modules[module_name], "weight_loader", default_weight_loader)
        parent, _, local = module_name.rpartition(".")
        for checkpoint_module, shard_id in shards_of.get(local, [(local, None)]):
            key = ".".join(part for part in (parent, checkpoint_module, leaf) if part)
            value = tensors.pop(key, None) if consume else tensors.get(key)
            _load_one(loader, param, value, shard_id, key, source, what)
        if last[module_name] == j:
            _finish(modules[module_name])
    for module_name, module in modules.items():
        if module_name not in last:
            _finish(module)


def _load_one(loader, param, value, shard_id, key: str, source, what: str) -> None:
    if value is None:
        missing = f"{what} weight {key!r} is missing" if what else f"checkpoint is missing tensor {key!r}"
        raise ValueError(f"{source}: {missing}")
    try:
        if shard_id is None:
            loader(param, value)
        else:
            loader(param, value, shard_id)
    except ValueError as e:
        raise ValueError(f"{source}: {what + ' weight' if what else 'tensor'} {key!r} {e}") from None


def _finish(module: nn.Module) -> None:
    finish = getattr(module, "finish_loading", None)
    if finish is not None:
        finish()


def load_draft(
    model: M, tensors: Mapping[str, Tensor], folder: Path, what: str, device: torch.device, dtype: torch.dtype
) -> M:
    """A draft head's weights loaded on the CPU in float32 (load_weights), then the head moved to `device` / `dtype`
    in eval mode."""
    load_weights(model, tensors, folder, what)
    return model.to(device=device, dtype=dtype).eval()


def load_decoder_weights(
    model: DecoderLM, tensors: dict[str, Tensor], source: str, shard: Shard | None = None
) -> None:
    """A target checkpoint's weights (safetensors, or a GGUF with HF names) into `model`: its names without the
    `model.` (or `model.language_model.`) prefix, and with tied embeddings the LM head read from the embedding
    (the head keeps its own packed or quantized copy). Empties `tensors`. `shard`: a tensor-parallel rank's, which
    keeps its slices. Raises ValueError on missing / misshapen tensors."""
    prefix = "model." if any(k.startswith("model.") for k in tensors) else ""
    if any(k.startswith("model.language_model.") for k in tensors):
        prefix = "model.language_model."
    # taken out of `tensors`: each checkpoint copy is freed once its layer holds its own
    named = {k.removeprefix(prefix): tensors.pop(k) for k in list(tensors)}
    if model.cfg.tie_word_embeddings:
        named.pop("lm_head.weight", None)
        if "embed_tokens.weight" in named:
            named["lm_head.weight"] = named["embed_tokens.weight"]
    if shard is not None:
        named = shard.shard_tensors(named)
    load_weights(model, named, source, consume=True)
