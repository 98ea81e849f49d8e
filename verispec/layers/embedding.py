"""Token embeddings: a quantized table (a GGUF's) stays in its blocks on the CPU and each lookup dequantizes its
rows, the very values a float32 table would hold; otherwise a float table."""

from __future__ import annotations

import torch
from torch import nn

from verispec.kernels.qweight import QuantWeight
from verispec.layers.linear import runs_quantized
from verispec.layers.weight_loader import Tensor, default_weight_loader

# the layouts whose rows a lookup dequantizes (repack.c's dequant_gather)
ROW_FORMATS = ("q4", "q8", "q6")


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # no random init: the loader fills it
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.qweight: QuantWeight | None = None

    def weight_loader(self, param: nn.Parameter, value: Tensor) -> None:
        """A quantized table is kept as it is where lookups can dequantize it (CPU, float32, native kernels); the
        float parameter is then released. Anything else is copied into the float table."""
        w = self.weight
        if isinstance(value, QuantWeight) and value.fmt in ROW_FORMATS and runs_quantized(w):
            if tuple(value.shape) != tuple(w.shape):
                raise ValueError(f"has shape {tuple(value.shape)}, expected {tuple(w.shape)}")
            self.qweight = value
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            return
        default_weight_loader(param, value)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., embedding_dim]."""
        if self.qweight is None:
            return nn.functional.embedding(ids, self.weight)
        return self.qweight.rows(ids).view(*ids.shape, self.embedding_dim)
