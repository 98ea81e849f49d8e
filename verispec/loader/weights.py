"""Map HF-named tensors (from safetensors or a dequantised GGUF) onto DecoderLM's fused modules."""

from __future__ import annotations

import torch

from verispec.kernels.qweight import QuantWeight, kernels_available
from verispec.models.decoder import DecoderLM

Tensor = (
    torch.Tensor | QuantWeight
)  # a GGUF loaded with keep_quantized=True gives QuantWeights for projections


def _dense(value: Tensor) -> torch.Tensor:
    return value.dequantize() if isinstance(value, QuantWeight) else value


def _cat_rows(parts: list[Tensor]) -> Tensor:
    """Stack the rows of several weights (fused qkv / gate_up); quantized stays quantized when formats agree."""
    if all(isinstance(p, QuantWeight) for p in parts):
        fused = QuantWeight.cat(parts)
        if fused is not None:
            return fused
    return torch.cat([_dense(p) for p in parts], dim=0)


def _take(tensors: dict[str, Tensor], name: str, source: str) -> Tensor:
    if name not in tensors:
        raise ValueError(f"{source}: checkpoint is missing tensor '{name}'")
    return tensors[name]


def load_decoder_weights(model: DecoderLM, tensors: dict[str, Tensor], source: str) -> None:
    """Copy weights into `model` (float32 or the model's dtype). Raises ValueError on missing/misshaped tensors."""
    cfg = model.cfg
    prefix = "model." if any(k.startswith("model.") for k in tensors) else ""
    if any(k.startswith("model.language_model.") for k in tensors):
        prefix = "model.language_model."
    gemma = cfg.is_gemma

    def get(name: str) -> Tensor:
        return _take(tensors, prefix + name, source)

    def put(param: torch.nn.Parameter, value: Tensor, name: str, norm: bool = False) -> None:
        value = _dense(value)
        if norm and gemma:
            value = value.float() + 1.0  # Gemma multiplies by (1 + w)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"{source}: tensor '{name}' has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(value.to(param.dtype))

    cpu_f32 = (
        model.embed_tokens.weight.device.type == "cpu" and model.embed_tokens.weight.dtype == torch.float32
    )
    quantized_ok = cpu_f32 and kernels_available()

    def dense(module, weight: Tensor, bias: torch.Tensor | None, name: str) -> None:
        try:
            if isinstance(weight, QuantWeight) and quantized_ok:
                return module.load_quantized(weight, bias, name)
            weight = _dense(weight)
            module.load(
                weight.to(module.weight.dtype), None if bias is None else bias.to(module.weight.dtype), name
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    put(model.embed_tokens.weight, get("embed_tokens.weight"), "embed_tokens.weight")
    put(model.norm.weight, get("norm.weight"), "norm.weight", norm=True)
    # tied: the head keeps its own packed (or quantized) copy of the embeddings; untied: its own tensor, required
    head = get("embed_tokens.weight") if cfg.tie_word_embeddings else _take(tensors, "lm_head.weight", source)
    dense(model.lm_head, head, None, "lm_head.weight")
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        at = layer.self_attn
        qkv = _cat_rows([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        bias = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if cfg.attention_bias else None
        dense(at.qkv_proj, qkv, bias, p + "self_attn.qkv_proj")
        dense(at.o_proj, get(p + "self_attn.o_proj.weight"), None, p + "self_attn.o_proj.weight")
        if cfg.qk_norm:
            put(at.q_norm.weight, get(p + "self_attn.q_norm.weight"), p + "q_norm", norm=True)
            put(at.k_norm.weight, get(p + "self_attn.k_norm.weight"), p + "k_norm", norm=True)
        gate_up = _cat_rows([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        dense(layer.mlp.gate_up_proj, gate_up, None, p + "mlp.gate_up_proj")
        dense(layer.mlp.down_proj, get(p + "mlp.down_proj.weight"), None, p + "mlp.down_proj.weight")
        put(layer.input_layernorm.weight, get(p + "input_layernorm.weight"), p + "input_layernorm", norm=True)
        put(
            layer.post_attention_layernorm.weight,
            get(p + "post_attention_layernorm.weight"),
            p + "post_attention_layernorm",
            norm=True,
        )
        if layer.sandwich:
            for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                put(getattr(layer, n).weight, get(p + n + ".weight"), p + n, norm=True)
