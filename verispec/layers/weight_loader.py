"""The weight loader a parameter without a module-specific one takes (vLLM's default_weight_loader)."""

from __future__ import annotations

import torch
from torch import nn

from verispec.kernels.qweight import QuantWeight

# A GGUF loaded with keep_quantized=True gives QuantWeights for its 2-D projections.
Tensor = torch.Tensor | QuantWeight


def default_weight_loader(param: nn.Parameter, value: Tensor) -> None:
    """Copy `value` (dequantized if quantized) into `param`, cast to its dtype."""
    if isinstance(value, QuantWeight):
        value = value.dequantize()
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value.to(param.dtype))
