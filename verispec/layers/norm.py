"""RMSNorm (HF formula). Gemma's (1 + w) convention is folded into the weight at load time."""

from __future__ import annotations

import torch
from torch import nn

from verispec.kernels import cuda_ops, ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self._fused(x, None)
        return fused[1] if fused is not None else self.reference(x)

    def add_forward(self, h: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + a, norm(h + a)) in one pass where the fused kernel applies."""
        fused = self._fused(h, a)
        if fused is not None:
            return fused
        h = h + a
        return h, self.reference(h)

    def _fused(self, h: torch.Tensor, a: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + a, norm(h + a)) by the CPU kernel, or the batch-invariant CUDA one; None where neither applies."""
        fused = ops.add_rmsnorm(h, a, self.weight, self.eps)
        if fused is None and cuda_ops.applies(h):
            fused = cuda_ops.add_rmsnorm(h, a, self.weight, self.eps)
        return fused

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        # Written out: on CPU, F.rms_norm is a composite with dtype round trips that costs ~4x more per call.
        # mean as sum/div: aten::mean adds a dtype round trip per call on CPU (same value: sum / D)
        var = x.pow(2).sum(-1, keepdim=True).div_(x.shape[-1])
        return x * torch.rsqrt(var + self.eps) * self.weight
