"""Dense layer tuned for decoding on the CPU.

GGUF weights in Q4_0 / Q4_1 / Q4_K / Q5_0 / Q8_0 / Q6_K stay in their blocks (`load_quantized`) and run through
verispec/kernels (the same float32 weight values, 4-9x fewer bytes streamed per token), with float32 activations
or, after `use_int8_activations`, activations quantized to int8 per row and 32-block (llama.cpp's numerics).
Otherwise, on CPU with MKL, weights are pre-packed once (MKL's packed SGEMM, the layout torch.compile's CPU backend
uses): for the few-row products of decoding and verification it runs faster than nn.Linear, and
its result for a row does not depend on how many rows are in the batch (bitwise), which keeps plain
decoding and speculative verification numerically identical. On CUDA it runs cuBLAS products of a fixed row
count (cuda_ops.linear), batch-invariant as well; elsewhere (no MKL) it is x @ W^T.

A fused layer (qkv, gate_up) declares its shards and loads each checkpoint weight into its rows
(`weight_loader`, called by verispec/loader/weights.py:load_weights).
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.kernels import cuda_ops
from verispec.kernels.qweight import GROUP, QK, QuantWeight, kernels_available

PACK_ROWS_HINT = 16

ShardId = str | int | None


def _mkl_packing_available() -> bool:
    return (
        hasattr(torch.ops, "mkl")
        and hasattr(torch.ops.mkl, "_mkl_linear")
        and torch.backends.mkl.is_available()
    )


def runs_quantized(weight: torch.Tensor) -> bool:
    """Whether a layer with this float parameter can keep quantized blocks instead: CPU, float32, native kernels."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and kernels_available()


class Dense(nn.Module):
    """y = x W^T (+ b). A fused layer (qkv, gate_up) declares its shards: the rows of each separate checkpoint
    weight, in row order ({"q": Hq*D, "k": Hkv*D, "v": Hkv*D}); `weight_loader` copies each into its rows."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shards: dict[str | int, int] | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # HF layout [out, in]
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.shards = dict(shards or {})
        if self.shards and sum(self.shards.values()) != out_features:
            raise ValueError(f"shards {self.shards} do not add up to out_features={out_features}")
        self._packed: torch.Tensor | None = None
        self.qweight: QuantWeight | None = None
        # keep quantized weights in the file's blocks (q4 / q8 / q6), not the float32 kernels' layout (the AMX
        # build's q4t / q8t tiles): set on a model about to take int8 activations, whose layouts are made from them
        self.file_layout = False
        # the shards kept quantized apart, in row order, where their formats differ (a Q4_K_M file's q / k / v)
        self.qparts: list[QuantWeight] | None = None
        # quantized weights (or shards) held by weight_loader until finish_loading
        self._pending: dict[ShardId, QuantWeight] = {}

    def shard_rows(self, shard_id: ShardId) -> slice:
        """The rows of shard `shard_id` in the weight (None: all of them)."""
        if shard_id is None:
            return slice(0, self.out_features)
        start = 0
        for sid, rows in self.shards.items():
            if sid == shard_id:
                return slice(start, start + rows)
            start += rows
        raise KeyError(f"Dense has no shard {shard_id!r}; its shards: {list(self.shards)}")

    def weight_loader(
        self, param: nn.Parameter, value: torch.Tensor | QuantWeight, shard_id: ShardId = None
    ) -> None:
        """Copy `value` (the whole weight or bias, or shard `shard_id` of it) into its rows of `param`; ValueError
        "has shape .., expected .." if it does not fit. A quantized weight is held for finish_loading where this
        layer runs on quantized blocks (CPU, float32, native kernels), else dequantized."""
        rows = self.shard_rows(shard_id)
        want = (rows.stop - rows.start, *param.shape[1:])
        if tuple(value.shape) != want:
            raise ValueError(f"has shape {tuple(value.shape)}, expected {want}")
        if isinstance(value, QuantWeight):
            if param is self.weight and self._runs_quantized():
                self._pending[shard_id] = value
                return
            value = value.dequantize()
        with torch.no_grad():
            param[rows].copy_(value.to(param.dtype))

    def _runs_quantized(self) -> bool:
        return runs_quantized(self.weight)

    def finish_loading(self) -> None:
        """Once every weight is in: the held quantized weight, or all shards quantized in one format, stacked into
        one quantized weight (`load_quantized`), or shards quantized in different formats kept apart
        (`load_parts`); else each held shard dequantized into its rows and the float weight packed."""
        parts, self._pending = self._pending, {}
        ids = list(self.shards) or [None]
        if all(i in parts for i in ids):
            fused = parts[ids[0]] if len(ids) == 1 else QuantWeight.cat([parts[i] for i in ids])
            if fused is not None:
                self.load_quantized(fused)
                return
            if len({parts[i].shape[1] for i in ids}) == 1:
                self.load_parts([parts[i] for i in ids])
                return
        with torch.no_grad():
            for shard_id, part in parts.items():
                self.weight[self.shard_rows(shard_id)].copy_(part.dequantize())
        self.pack()

    def load_quantized(self, weight: QuantWeight) -> None:
        """Keep `weight` [out, in] in its quantized blocks (in the layout this CPU's kernels run fastest); the
        float32 parameter is released."""
        assert tuple(weight.shape) == (self.out_features, self.in_features), weight.shape
        self.qweight, self._packed = (weight if self.file_layout else weight.for_kernels()), None
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def load_parts(self, parts: list[QuantWeight]) -> None:
        """Keep the shards `parts` (in row order) each in its quantized blocks; the float32 parameter is released."""
        assert sum(p.shape[0] for p in parts) == self.out_features, [p.shape for p in parts]
        self.qparts, self._packed = [p if self.file_layout else p.for_kernels() for p in parts], None
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    @property
    def quantized(self) -> bool:
        """Whether this layer runs on quantized blocks (one weight, or its shards apart)."""
        return self.qweight is not None or self.qparts is not None

    def quantize_q8(self) -> bool:
        """Keep this layer's weights as Q8_0 blocks for the native kernels (a draft following a quantized target);
        False, unchanged, where the kernels or the shape do not allow it."""
        w = self.weight
        if self.quantized or w.device.type != "cpu" or not kernels_available():
            return False
        if self.in_features % QK or self.out_features % GROUP:
            return False
        self.load_quantized(QuantWeight.quantize_q8(w))
        return True

    def use_int8_activations(self) -> bool:
        """Multiply this layer's quantized weights with int8 activations from now on (q4v / q8v, qgemm_i8.c);
        False, unchanged, if it has no quantized weights or their shape does not allow it (N not a multiple of 16:
        that layer keeps float32 activations)."""
        if self.qparts is not None:
            parts = [p.for_int8() for p in self.qparts]
            if any(p is None for p in parts):
                return False
            self.qparts = parts
            return True
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

    def _apply(self, fn, recurse: bool = True):
        # .to() / .cuda() / .bfloat16() move the weight but not MKL's packed copy of it: pack again (or drop it)
        out = super()._apply(fn, recurse)
        if self._packed is not None:
            self.pack()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            x2 = x.reshape(-1, self.in_features)
            # [M, out]
            y = (
                self.qweight.matmul(x2)
                if self.qparts is None
                else torch.cat([p.matmul(x2) for p in self.qparts], 1)
            )
            if self.bias is not None:
                y += self.bias
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if self._packed is None:
            if cuda_ops.applies(x):
                # batch-invariant products on CUDA
                return cuda_ops.linear(x, self.weight, self.bias)
            return nn.functional.linear(x, self.weight, self.bias)
        # the decoder's packed [N, hidden] activations: no reshapes on the hot path
        if x.dim() == 2:
            return torch.ops.mkl._mkl_linear(x, self._packed, self.weight, self.bias, x.shape[0])
        # [M, in] -> [M, out]
        x2 = x.reshape(-1, self.in_features)
        y = torch.ops.mkl._mkl_linear(x2, self._packed, self.weight, self.bias, x2.shape[0])
        return y.view(*x.shape[:-1], self.out_features)


def quantize_dense_layers(module: nn.Module) -> int:
    """Every Dense layer of `module` that can be -> Q8_0 (Dense.quantize_q8), and every nn.Linear (a draft head's)
    replaced by such a Dense; -> how many were."""
    n = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            dense = Dense(child.in_features, child.out_features, bias=child.bias is not None)
            with torch.no_grad():
                dense.weight.copy_(child.weight)
                if child.bias is not None:
                    dense.bias.copy_(child.bias)
            if dense.quantize_q8():
                setattr(parent, name, dense)
                n += 1
    return n + sum(m.quantize_q8() for m in module.modules() if isinstance(m, Dense))


def keep_file_layouts(module: nn.Module) -> None:
    """Every Dense layer of `module` keeps the weights it loads in the file's blocks (Dense.file_layout): for a model
    that takes int8 activations next, whose layouts are made from those blocks in C."""
    for m in module.modules():
        if isinstance(m, Dense):
            m.file_layout = True


def use_int8_activations(module: nn.Module) -> int:
    """Every quantized Dense layer of `module` -> int8 activations (Dense.use_int8_activations); -> how many."""
    return sum(m.use_int8_activations() for m in module.modules() if isinstance(m, Dense))


def keeps_quantized(module: nn.Module) -> bool:
    """Whether any Dense layer of `module` runs on quantized blocks (a GGUF target kept quantized)."""
    return any(isinstance(m, Dense) and m.quantized for m in module.modules())
