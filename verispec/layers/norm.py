"""RMSNorm (HF formula). Gemma's (1 + w) convention is folded into the weight at load time."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written out: on CPU, F.rms_norm is a composite with dtype round trips that costs ~4x more per call.
        # mean as sum/div: aten::mean adds a dtype round trip per call on CPU (same value: sum / D)
        var = x.pow(2).sum(-1, keepdim=True).div_(x.shape[-1])
        return x * torch.rsqrt(var + self.eps) * self.weight
