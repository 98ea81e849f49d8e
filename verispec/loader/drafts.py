"""Draft checkpoints (EAGLE, EAGLE-3, MTP, Medusa, MLP speculator, DFlash) read from their folders into the
modules of verispec/models: config checks, tensors, one `load_draft` each."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from verispec.config import ModelConfig, config_int, model_config_from_hf
from verispec.loader.hf import (
    check_token_ids,
    load_hf_tensors,
    read_draft_config,
    read_hf_config,
    require_weights,
)
from verispec.loader.weights import load_draft
from verispec.models.dflash import _RENAMES, DFlashDraft, dflash_config
from verispec.models.dspark import DSparkConfig, DSparkDraft, dspark_config, merged_config
from verispec.models.eagle import SPECULATORS_NAMES, EagleDraft
from verispec.models.eagle3 import Eagle3Draft
from verispec.models.medusa import MedusaConfig, MedusaHeads
from verispec.models.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from verispec.models.mtp import MTPLayer

logger = logging.getLogger(__name__)


def load_eagle(
    folder: str | Path, device: torch.device, dtype: torch.dtype, parallel: bool = False
) -> EagleDraft:
    """parallel: a P-EAGLE draft (parallel drafting), whose `mask_hidden` state is loaded."""
    folder = Path(folder)
    hf = read_hf_config(folder)
    # EAGLE checkpoints name their own architectures (LlamaForCausalLMEagle, ...): the blocks are Llama blocks
    cfg = model_config_from_hf({**hf, "architectures": ["LlamaForCausalLM"]}, str(folder / "config.json"))
    tensors = {}
    for name, value in load_hf_tensors(folder).items():
        name = name.removeprefix("model.")
        tensors[SPECULATORS_NAMES.get(name, name)] = value
    last = f"layers.{cfg.num_layers - 1}.mlp.down_proj.weight"
    require_weights(tensors, [last], folder, "EAGLE", f"says {cfg.num_layers} layers")
    draft = EagleDraft(cfg, fc_bias="fc.bias" in tensors, para_norm=bool(hf.get("add_para_norm", False)))
    draft.mask_hidden = _mask_hidden(tensors, parallel, cfg.hidden_size, folder)
    return load_draft(draft, tensors, folder, "EAGLE", device, dtype)


def load_eagle3(
    folder: str | Path, device: torch.device, dtype: torch.dtype, target_hidden: int, parallel: bool = False
) -> Eagle3Draft:
    """parallel: a P-EAGLE draft (parallel drafting), whose `mask_hidden` (three target streams) is loaded."""
    folder = Path(folder)
    hf = read_hf_config(folder)
    cfg = model_config_from_hf({**hf, "architectures": ["LlamaForCausalLM"]}, str(folder / "config.json"))
    tensors = {}
    for name, value in load_hf_tensors(folder).items():
        name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
        # the block's weights sit at the top of Eagle3Draft
        tensors[name.removeprefix("midlayer.")] = value
    tensors.pop("t2d", None)
    where = str(folder / "config.json")
    draft_vocab = config_int(hf.get("draft_vocab_size") or cfg.vocab_size, "draft_vocab_size", where)
    if draft_vocab > cfg.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size={draft_vocab} exceeds vocab_size={cfg.vocab_size}")
    th = config_int(hf.get("target_hidden_size") or target_hidden, "target_hidden_size", where)
    own_embed = "embed_tokens.weight" in tensors
    draft = Eagle3Draft(cfg, th, draft_vocab, bool(hf.get("norm_before_residual", False)), own_embed)
    d2t = _vocab_map(tensors, "d2t", "draft_vocab_size", draft_vocab, cfg.vocab_size, folder, offsets=True)
    if d2t is not None:
        draft.d2t = d2t
    draft.mask_hidden = _mask_hidden(tensors, parallel, 3 * th, folder)
    return load_draft(draft, tensors, folder, "EAGLE-3", device, dtype)


def _mask_hidden(tensors: dict, parallel: bool, width: int, folder: Path) -> torch.Tensor | None:
    """P-EAGLE's learned state of the masked rows, taken out of `tensors`: [1, width] (the state an EAGLE draft
    reads per position; any shape of that many floats on disk), or None when not drafting in parallel (vLLM's
    checks and messages)."""
    t = tensors.pop("mask_hidden", None)
    if not parallel:
        if t is not None:
            logger.warning(
                "mask_hidden found in weights but model is not configured for parallel drafting. "
                "Skipping loading mask_hidden."
            )
        return None
    if t is None:
        raise ValueError(
            "mask_hidden not found in weights but model is configured for parallel drafting. "
            f"Please provide mask_hidden in the weights ({folder})."
        )
    if t.numel() != width or not t.is_floating_point():
        raise ValueError(
            f"{folder}: 'mask_hidden' must hold {width} floats (the state the draft reads per position), got "
            f"{t.dtype} {tuple(t.shape)}"
        )
    return t.reshape(1, width).float()


def _vocab_map(
    tensors: dict, name: str, size_key: str, n: int, vocab: int, folder: Path, offsets: bool = False
) -> torch.Tensor | None:
    """A draft's reduced-vocabulary map (EAGLE-3's d2t offsets, Medusa's token_map ids) taken out of `tensors`:
    int64 [n], checked against the target's vocabulary; None when the draft keeps the whole vocabulary."""
    t = tensors.pop(name, None)
    if n >= vocab:
        return None
    if t is None or tuple(t.shape) != (n,):
        what = "offsets" if offsets else "token ids"
        raise ValueError(
            f"{folder}: {size_key}={n} < vocab_size={vocab} needs a '{name}' tensor of {n} {what}"
        )
    check_token_ids(t, name, n, vocab, folder, offsets=offsets)
    return t.long()


def load_medusa(folder: str | Path, device: torch.device, dtype: torch.dtype) -> MedusaHeads:
    folder = Path(folder)
    hf = read_draft_config(folder, "medusa", "a Medusa")
    cfg = MedusaConfig.from_hf(hf, str(folder))
    tensors = {k.removeprefix("medusa_heads."): v for k, v in load_hf_tensors(folder).items()}
    last = f"blocks.{cfg.num_heads - 1}.layers.{cfg.num_hidden_layers - 1}.weight"
    require_weights(
        tensors, [last], folder, "Medusa", f"says {cfg.num_heads} heads of {cfg.num_hidden_layers} layers"
    )
    heads = MedusaHeads(cfg)
    n = cfg.truncated_vocab_size
    token_map = _vocab_map(tensors, "token_map", "truncated_vocab_size", n, cfg.vocab_size, folder)
    if token_map is not None:
        heads.token_map = token_map
    return load_draft(heads, tensors, folder, "Medusa", device, dtype)


def load_mlp_speculator(folder: str | Path, device: torch.device, dtype: torch.dtype) -> MLPSpeculator:
    folder = Path(folder)
    hf = read_draft_config(folder, "mlp_speculator", "an MLP speculator")
    cfg = MLPSpeculatorConfig.from_hf(hf, str(folder))
    tensors = {k.removeprefix("speculator."): v for k, v in load_hf_tensors(folder).items()}
    last = f"head.{0 if cfg.tie_weights else cfg.n_predict - 1}.weight"
    require_weights(tensors, [last], folder, "MLP speculator", f"says n_predict={cfg.n_predict}")
    model = MLPSpeculator(cfg)
    return load_draft(model, tensors, folder, "MLP speculator", device, dtype)


def load_mtp(folder: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> MTPLayer:
    """The first MTP layer of the target checkpoint at `folder` (its Qwen2 config `cfg`)."""
    folder = Path(folder)
    prefix = "model.mtp_layers.0."
    tensors = {k.removeprefix(prefix): v for k, v in load_hf_tensors(folder).items() if k.startswith(prefix)}
    if not tensors:
        raise ValueError(f"{folder}: no MTP layer weights ({prefix}*) in the checkpoint")
    block = {"self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm."}
    tensors = {("block." + k if any(k.startswith(b) for b in block) else k): v for k, v in tensors.items()}
    return load_draft(MTPLayer(cfg), tensors, folder, "MTP", device, dtype)


def load_dflash(
    folder: str | Path, device: torch.device, dtype: torch.dtype, target: ModelConfig
) -> DFlashDraft:
    """A DFlash draft for `target` (its layer count and hidden size size the fusion layer)."""
    return _load_block_draft(Path(folder), device, dtype, target, spark=False)


def load_dspark(
    folder: str | Path, device: torch.device, dtype: torch.dtype, target: ModelConfig
) -> DSparkDraft:
    """A DSpark draft for `target`: DFlash's backbone with a Markov head and a confidence head."""
    return _load_block_draft(Path(folder), device, dtype, target, spark=True)


def _load_block_draft(
    folder: Path, device: torch.device, dtype: torch.dtype, target: ModelConfig, spark: bool
) -> DFlashDraft:
    where = str(folder / "config.json")
    hf = read_hf_config(folder)
    what = "DSpark" if spark else "DFlash"
    if spark:
        hf = merged_config(hf)
    spec = dflash_config(hf, target.num_layers, where)
    if spark:
        # vLLM runs DSpark blocks non-causal whatever the config says
        spec = replace(spec, causal=False)
    # vLLM's default RoPE base for DFlash (Qwen3) drafts
    rope = {} if "rope_theta" in hf or "rope_parameters" in hf else {"rope_theta": 1_000_000.0}
    cfg = model_config_from_hf({**hf, **rope, "architectures": ["Qwen3ForCausalLM"]}, where)
    tensors = _block_draft_tensors(folder, cfg, what)
    fc_in = len(spec.aux_layers) * target.hidden_size
    fc = tensors.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (cfg.hidden_size, fc_in):
        raise ValueError(
            f"{folder}: 'fc.weight' has shape {tuple(fc.shape)} but {len(spec.aux_layers)} target layers "
            f"({[i - 1 for i in spec.aux_layers]}) of hidden size {target.hidden_size} need "
            f"({cfg.hidden_size}, {fc_in}): an incompatible draft / target pair"
        )
    draft_vocab = config_int(hf.get("draft_vocab_size") or cfg.vocab_size, "draft_vocab_size", where)
    if draft_vocab > cfg.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size={draft_vocab} exceeds vocab_size={cfg.vocab_size}")
    own = ("embed_tokens.weight" in tensors, "lm_head.weight" in tensors)
    if spark:
        sc = dspark_config(hf, draft_vocab, where)
        sc = _spark_heads(tensors, sc, folder)
        draft = DSparkDraft(cfg, spec, sc, fc_in, draft_vocab, *own)
        # vLLM's DSpark masks through the embedding's row: a mask_embedding is a placeholder
        tensors.pop("mask_embedding", None)
    else:
        draft = DFlashDraft(cfg, spec, fc_in, draft_vocab, *own)
    _mask_embedding(draft, tensors, folder)
    _block_draft_vocab(draft, tensors, draft_vocab, folder)
    return load_draft(draft, tensors, folder, what, device, dtype)


def _block_draft_tensors(folder: Path, cfg: ModelConfig, what: str) -> dict[str, torch.Tensor]:
    """A DFlash / DSpark checkpoint's tensors under this build's names, checked for the layers it promises."""
    tensors = {}
    for name, value in load_hf_tensors(folder).items():
        name = name.removeprefix("model.")
        for old, new in _RENAMES:
            name = name.replace(old, new)
        tensors[name] = value
    tensors.pop("t2d", None)
    dflash2 = sorted(n for n in tensors if n.startswith("candidate_selector.") or "_conv." in n)
    if dflash2:
        raise ValueError(
            f"{folder}: {dflash2[0]!r} belongs to a DFlash2 draft (candidate selector, dynamic convolutions), which "
            "this build does not run; it runs DFlash drafts"
        )
    last = f"layers.{cfg.num_layers - 1}.input_layernorm.weight"
    require_weights(tensors, [last], folder, what, f"says {cfg.num_layers} layers")
    return tensors


def _spark_heads(tensors: dict, sc: DSparkConfig, folder: Path) -> DSparkConfig:
    """The Markov head's weights must be there when markov_rank > 0; a confidence head the config enables but the
    weights lack is left out (vLLM's rule), with a warning."""
    if sc.markov_rank:
        names = ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
        require_weights(tensors, names, folder, "DSpark", f"says markov_rank={sc.markov_rank}")
    if sc.confidence and "confidence_head.proj.weight" not in tensors:
        logger.warning(
            "%s: enable_confidence_head is set but the weights have no confidence head; none used", folder
        )
        return replace(sc, confidence=False)
    if not sc.confidence:
        for name in [n for n in tensors if n.startswith("confidence_head.")]:
            tensors.pop(name)
    return sc


def _mask_embedding(draft: DFlashDraft, tensors: dict, folder: Path) -> None:
    cfg = draft.cfg
    if (folder / "mask_embedding.pt").is_file():
        raise ValueError(
            f"{folder}: mask_embedding.pt is a pickle, which this build does not load; store the embedding as a "
            "tensor 'mask_embedding' in a .safetensors file of the folder instead"
        )
    mask_embedding = tensors.pop("mask_embedding", None)
    if mask_embedding is not None:
        if mask_embedding.numel() != cfg.hidden_size or not mask_embedding.is_floating_point():
            raise ValueError(
                f"{folder}: 'mask_embedding' must hold {cfg.hidden_size} floats (the hidden size), got "
                f"{mask_embedding.dtype} {tuple(mask_embedding.shape)}"
            )
        draft.mask_embedding = mask_embedding.reshape(-1).float()


def _block_draft_vocab(draft: DFlashDraft, tensors: dict, draft_vocab: int, folder: Path) -> None:
    """A reduced draft vocabulary needs the checkpoint's own LM head and its d2t offsets."""
    cfg = draft.cfg
    d2t = tensors.pop("d2t", None)
    if draft_vocab != cfg.vocab_size:
        if draft.lm_head is None or d2t is None:
            raise ValueError(
                f"{folder}: draft_vocab_size={draft_vocab} < vocab_size={cfg.vocab_size} needs its own "
                f"'lm_head.weight' and a 'd2t' tensor of {draft_vocab} offsets"
            )
        check_token_ids(d2t, "d2t", draft_vocab, cfg.vocab_size, folder, offsets=True)
        draft.d2t = d2t.long()
