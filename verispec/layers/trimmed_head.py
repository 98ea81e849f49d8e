"""A draft's LM head over part of its vocabulary (FR-Spec / VocabTrim; llama.cpp's `--spec-draft-vocab`).

A draft model's head is a large share of the bytes its every token reads (Qwen2.5-Coder-0.5B: 151,936 x 896 of
about 0.5 B weights). `TrimmedHead` multiplies only the kept rows and returns logits over the whole vocabulary,
-inf outside the kept ids, so everything after it (argmax, sampling, the draft's q, the vocabulary map) is unchanged:
the draft never proposes a token outside the set, and the target's verification keeps the output exactly its own.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.kernels.qweight import INT8_FMT_CODE, QuantWeight
from verispec.layers.linear import Dense


class TrimmedHead(nn.Module):
    def __init__(self, dense: Dense, keep: torch.Tensor, vocab_size: int):
        super().__init__()
        # [n] int64, sorted: the vocabulary ids of dense's rows
        self.register_buffer("keep", keep, persistent=False)
        self.dense = dense
        self.in_features, self.out_features = dense.in_features, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., n]
        y = self.dense.forward(x)
        out = torch.full((*y.shape[:-1], self.out_features), float("-inf"), dtype=y.dtype, device=y.device)
        # [..., V]
        return out.index_copy_(-1, self.keep, y)


def trim_head(head: Dense, keep: torch.Tensor) -> TrimmedHead:
    """`head` [V, H] -> the same layer over rows `keep` only (sorted int64 ids), kept in the head's own format:
    quantized blocks stay the same blocks (rows of a quantized weight are independent), float rows are copied."""
    keep = keep.to(torch.int64).cpu()
    n, hidden = int(keep.numel()), head.in_features
    dense = Dense(hidden, n, bias=head.bias is not None)
    dense.file_layout = head.file_layout
    if head.qweight is not None:
        # the file's blocks (q4 / q8 / q6), whatever layout the kernels had them in
        base = head.qweight.untiled()
        if base.fmt not in ("q4", "q8", "q6"):
            raise ValueError(f"cannot trim an LM head in the {base.fmt} layout")
        rows = QuantWeight(base.fmt, base.blocks[keep.numpy()].copy(), (n, hidden))
        dense.load_quantized(rows)
        # int8 activations where the head had them
        if head.qweight.fmt in INT8_FMT_CODE and not dense.use_int8_activations():
            raise ValueError(
                f"a trimmed head of {n} rows cannot take int8 activations (not a multiple of 16)"
            )
    else:
        if head.qparts is not None:
            raise ValueError("cannot trim an LM head kept in quantized parts")
        weight = head.weight.detach()
        with torch.no_grad():
            dense.weight = nn.Parameter(
                weight.index_select(0, keep.to(weight.device)).clone(), requires_grad=False
            )
        dense.pack()
    if head.bias is not None:
        with torch.no_grad():
            dense.bias.copy_(head.bias.detach()[keep.to(head.bias.device)])
    # (a quantized head's weight is an empty CPU tensor: the ids stay on the CPU with its blocks)
    return TrimmedHead(dense, keep.to(head.weight.device), head.out_features)
