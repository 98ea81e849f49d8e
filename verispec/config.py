"""Plain configuration dataclasses. No I/O here: loaders build these from config.json / GGUF metadata."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    # Qwen2 blocks plus MTP layers (the `mtp` method's draft)
    "MiMoForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the model code needs, normalised across Llama/Qwen/Gemma configs."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    # Gemma 3
    rope_local_theta: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    hidden_act: str = "silu"

    @property
    def is_gemma(self) -> bool:
        return self.architecture == "Gemma3ForCausalLM"

    def layer_is_sliding(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "sliding_attention"

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V for every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def _require(cfg: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in cfg:
        raise ValueError(f"{source}: config is missing required key '{key}'")
    return cfg[key]


def config_int(value: Any, key: str, source: str, least: int = 1) -> int:
    """An integer config value >= least; ValueError naming the key otherwise (no bare int() errors)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{source}: '{key}' must be an integer >= {least}, got {value!r}")
    return int(value)


def _rope_settings(text: Mapping[str, Any], is_gemma: bool) -> tuple[float, float, dict | None]:
    """(global theta, local theta, scaling) from either transformers 4 keys or 5's `rope_parameters`."""
    params = text.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        glob, local = params.get("full_attention", {}), params.get("sliding_attention", {})
    else:
        glob, local = params, {}
    theta = glob.get("rope_theta", text.get("rope_theta", 1_000_000.0 if is_gemma else 10_000.0))
    local_theta = local.get("rope_theta", text.get("rope_local_base_freq", 10_000.0))
    scaling = text.get("rope_scaling")
    if scaling is None and glob.get("rope_type", "default") != "default":
        scaling = glob
    return float(theta), float(local_theta), scaling


def model_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a transformers-style config.json dict."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    text = cfg.get("text_config") or cfg
    hidden = config_int(_require(text, "hidden_size", source), "hidden_size", source)
    heads = config_int(_require(text, "num_attention_heads", source), "num_attention_heads", source)
    head_dim = text.get("head_dim") or hidden // heads
    is_gemma = arch == "Gemma3ForCausalLM"
    num_layers = config_int(_require(text, "num_hidden_layers", source), "num_hidden_layers", source)
    layer_types: tuple[str, ...] = tuple(text.get("layer_types") or ())
    if is_gemma and not layer_types:
        pattern = int(text.get("sliding_window_pattern", 6))
        layer_types = tuple(
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
        )
    rope_theta, rope_local, rope_scaling = _rope_settings(text, is_gemma)
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind not in ("default", "llama3", "linear"):
            raise ValueError(
                f"{source}: unsupported rope_scaling type {kind!r}; supported: default, linear, llama3"
            )
        rope_scaling = tuple(
            sorted((k, v) for k, v in rope_scaling.items() if not isinstance(v, (list, dict)))
        )
    if arch == "Qwen3ForCausalLM":
        default_bias = False
    else:
        default_bias = arch in ("Qwen2ForCausalLM", "MiMoForCausalLM")
    return ModelConfig(
        architecture=arch,
        model_type=str(text.get("model_type", cfg.get("model_type", ""))),
        vocab_size=config_int(_require(text, "vocab_size", source), "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=config_int(
            _require(text, "intermediate_size", source), "intermediate_size", source
        ),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=config_int(text.get("num_key_value_heads") or heads, "num_key_value_heads", source),
        head_dim=config_int(head_dim, "head_dim", source),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=config_int(
            text.get("max_position_embeddings", 2048), "max_position_embeddings", source
        ),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", is_gemma))),
        attention_bias=bool(text.get("attention_bias", default_bias)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        rope_scaling=rope_scaling,
        rope_local_theta=rope_local if is_gemma else None,
        sliding_window=text.get("sliding_window") if is_gemma else None,
        layer_types=layer_types if is_gemma else (),
        query_pre_attn_scalar=text.get("query_pre_attn_scalar") if is_gemma else None,
        final_logit_softcapping=text.get("final_logit_softcapping"),
        attn_logit_softcapping=text.get("attn_logit_softcapping"),
        hidden_act=str(text.get("hidden_activation") or text.get("hidden_act") or "silu"),
    )
