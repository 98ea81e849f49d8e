"""Rotary position embeddings (HF "rotate half" layout), computed once per forward from positions."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    # device="cpu" explicitly: under torch.device("meta") an implicit arange would import torch._dynamo (~1 s)
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    # [D/2]
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq.float()


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [S, Q] -> cos, signed sin [S, 1, Q, D] (broadcast over heads), computed in float32.

    The sin half that multiplies x1 is negated so that rotate_half(x) * sin == roll(x, D/2) * signed_sin.
    """
    # [S, 1, Q, D/2]
    freqs = (positions.unsqueeze(-1).float() * inv_freq).unsqueeze(1)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [S, H, Q, D] -> x * cos + rotate_half(x) * sin (HF layout), in three kernels."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
