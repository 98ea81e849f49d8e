"""Read a Hugging Face checkpoint folder: config.json and (sharded) *.safetensors. Never pickle."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from verispec.loader.files import read_json
from verispec.loader.gguf import load_gguf_tensors


def read_draft_config(folder: Path, model_type: str, what: str) -> dict:
    """A draft checkpoint's config.json, which must declare `model_type` (Medusa, MLP speculator)."""
    hf = read_hf_config(folder)
    if hf.get("model_type") != model_type:
        raise ValueError(
            f"{folder}: not {what} checkpoint (model_type {hf.get('model_type')!r}, expected '{model_type}')"
        )
    return hf


def read_hf_config(folder: Path) -> dict:
    if folder.is_file():
        raise ValueError(f"{folder}: a file, not a model folder (pass the folder that holds config.json)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: not a model folder (no config.json)")
    return read_json(folder / "config.json")


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names")
        names = sorted(set(weight_map.values()))
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors weights found (pickle .bin weights are not loaded)")
    for f in files:
        if not f.is_file():
            raise ValueError(f"{f}: shard listed in model.safetensors.index.json is missing")
    return files


def load_hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's safetensors weights, or, in a folder without any, its *.gguf files' tensors by their own names
    (draft weights stored as GGUF blocks)."""
    tensors: dict[str, torch.Tensor] = {}
    ggufs = sorted(folder.glob("*.gguf"))
    if ggufs and not any(folder.glob("*.safetensors")):
        for f in ggufs:
            tensors.update(load_gguf_tensors(f))
        return tensors
    for f in safetensors_files(folder):
        try:
            tensors.update(load_file(str(f)))
        # safetensors raises its own error types for corrupt headers
        except Exception as e:
            raise ValueError(f"{f}: corrupt or unreadable safetensors file ({e})") from None
    return tensors


def check_token_ids(
    t: torch.Tensor, name: str, length: int, vocab: int, folder: Path, offsets: bool = False
) -> None:
    """A draft checkpoint's integer token-id map (Medusa `token_map`, EAGLE-3 `d2t` offsets): integer dtype, `length`
    entries, every id (i + t[i] for offsets) in [0, vocab); ValueError naming it otherwise."""
    if t.dtype.is_floating_point or t.dtype == torch.bool or tuple(t.shape) != (length,):
        raise ValueError(
            f"{folder}: '{name}' must be {length} integer token ids, got {t.dtype} {tuple(t.shape)}"
        )
    ids = t.long() + (torch.arange(length) if offsets else 0)
    if length and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"{folder}: '{name}' maps to token ids outside [0, {vocab})")


def require_weights(tensors: dict, names: list[str], folder: Path, what: str, why: str) -> None:
    """Weights the config promises, checked before any module is allocated (a huge count fails here, not in OOM)."""
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{folder}: {what} config {why}, but the checkpoint has no {missing[0]!r}")
