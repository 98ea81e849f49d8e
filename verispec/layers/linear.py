"""Dense layer tuned for decoding on the CPU.

GGUF weights in Q4_0 / Q4_1 / Q4_K / Q5_0 / Q8_0 / Q6_K stay in their blocks (`load_quantized`) and run through
verispec/kernels (the same float32 weight values, 4-9x fewer bytes streamed per token), with float32 activations
or, after `use_int8_activations`, activations quantized to int8 per row and 32-block (llama.cpp's numerics). Otherwise, on CPU with MKL, weights are pre-packed once (MKL's packed SGEMM, the layout torch.compile's CPU backend
uses): for the 1-40 row products of decoding and verification it runs 1.2-2x faster than nn.Linear, and
its result for a row does not depend on how many rows are in the batch (bitwise), which keeps plain
decoding and speculative verification numerically identical. Elsewhere (CUDA, no MKL) it is x @ W^T.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.kernels.qweight import QuantWeight

PACK_ROWS_HINT = 16


def _mkl_packing_available() -> bool:
    return (
        hasattr(torch.ops, "mkl")
        and hasattr(torch.ops.mkl, "_mkl_linear")
        and torch.backends.mkl.is_available()
    )


class Dense(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # HF layout [out, in]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._packed: torch.Tensor | None = None
        self.qweight: QuantWeight | None = None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "") -> None:
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"tensor '{name}' has shape {tuple(weight.shape)}, expected {tuple(self.weight.shape)}"
            )
        with torch.no_grad():
            self.weight.copy_(weight)
            if bias is not None:
                self.bias.copy_(bias)
        self.pack()

    def load_quantized(self, weight: QuantWeight, bias: torch.Tensor | None = None, name: str = "") -> None:
        """Keep `weight` in its quantized blocks (in the layout this CPU's kernels run fastest); the float32 parameter
        is released."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"tensor '{name}' has shape {tuple(weight.shape)}, expected {(self.out_features, self.in_features)}"
            )
        self.qweight, self._packed = weight.for_kernels(), None
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        if bias is not None:
            with torch.no_grad():
                self.bias.copy_(bias)

    def quantize_q8(self) -> bool:
        """Keep this layer's weights as Q8_0 blocks for the native kernels (a draft following a quantized target);
        False, unchanged, where the kernels or the shape do not allow it."""
        from verispec.kernels.qweight import GROUP, QK, kernels_available

        w = self.weight
        if self.qweight is not None or w.device.type != "cpu" or not kernels_available():
            return False
        if self.in_features % QK or self.out_features % GROUP:
            return False
        self.load_quantized(QuantWeight.quantize_q8(w))
        return True

    def use_int8_activations(self) -> bool:
        """Multiply this layer's quantized weights with int8 activations from now on (q4v / q8v, qgemm_i8.c);
        False, unchanged, if it has no quantized weights or their shape does not allow it (N not a multiple of 16:
        that layer keeps float32 activations)."""
        qv = self.qweight.for_int8() if self.qweight is not None else None
        if qv is None:
            return False
        self.qweight = qv
        return True

    def pack(self) -> None:
        w = self.weight
        if w.device.type == "cpu" and w.dtype == torch.float32 and _mkl_packing_available():
            self._packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), PACK_ROWS_HINT)
        else:
            self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            y = self.qweight.matmul(x.reshape(-1, self.in_features))  # [M, out]
            if self.bias is not None:
                y += self.bias
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if self._packed is None:
            return nn.functional.linear(x, self.weight, self.bias)
        if x.dim() == 2:  # the decoder's packed [N, hidden] activations: no reshapes on the hot path
            return torch.ops.mkl._mkl_linear(x, self._packed, self.weight, self.bias, x.shape[0])
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        y = torch.ops.mkl._mkl_linear(x2, self._packed, self.weight, self.bias, x2.shape[0])  # [M, out]
        return y.view(*x.shape[:-1], self.out_features)


def quantize_dense_layers(module: nn.Module) -> int:
    """Every Dense layer of `module` that can be -> Q8_0 (Dense.quantize_q8); -> how many were."""
    return sum(m.quantize_q8() for m in module.modules() if isinstance(m, Dense))


def use_int8_activations(module: nn.Module) -> int:
    """Every quantized Dense layer of `module` -> int8 activations (Dense.use_int8_activations); -> how many."""
    return sum(m.use_int8_activations() for m in module.modules() if isinstance(m, Dense))


def keeps_quantized(module: nn.Module) -> bool:
    """Whether any Dense layer of `module` runs on quantized blocks (a GGUF target kept quantized)."""
    return any(isinstance(m, Dense) and m.qweight is not None for m in module.modules())
