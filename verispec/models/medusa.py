"""Medusa heads (Cai et al. 2024, https://arxiv.org/abs/2401.10774), in vLLM's checkpoint format.

Head h reads the target's final (normed) hidden state x at the newest committed token and predicts the token h + 1
positions after the next one: logits_h = lm_head_h(block_h(x)), block_h = num_hidden_layers residual steps
x <- x + SiLU(W x (+ b)).

Checkpoint: an HF folder with config.json (`model_type: "medusa"`, `hidden_size`, `vocab_size`, the head count
under any key naming "num" and "heads" (`num_heads`, `medusa_num_heads`), the layer count under any key naming
"num" and "layers", optional `truncated_vocab_size` with a `token_map` tensor, `original_lm_head` (one shared head
stored as `lm_heads.0.weight`), `medusa_fc_bias`, `logit_scale`) and safetensors `blocks.{h}.layers.{l}.weight`
(`.bias`), `lm_heads.{h}.weight` (an optional `medusa_heads.` prefix is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_hidden_layers: int
    truncated_vocab_size: int
    original_lm_head: bool = False
    fc_bias: bool = False
    logit_scale: float = 1.0

    @classmethod
    def from_hf(cls, hf: dict, where: str) -> MedusaConfig:
        """vLLM's MedusaConfig: keys naming "num" + "heads" / "num" + "layers" are the head / layer counts."""
        heads = next((v for k, v in hf.items() if "num" in k and "heads" in k), None)
        layers = next((v for k, v in hf.items() if "num" in k and "layers" in k), 1)
        ints = {
            "hidden_size": hf.get("hidden_size"),
            "vocab_size": hf.get("vocab_size"),
            "num_heads": heads,
            "num_hidden_layers": layers,
        }
        for key, value in ints.items():
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{where}: Medusa config.json needs a positive integer {key}, got {value!r}")
        truncated = hf.get("truncated_vocab_size") or ints["vocab_size"]
        if (
            isinstance(truncated, bool)
            or not isinstance(truncated, int)
            or not 0 < truncated <= ints["vocab_size"]
        ):
            raise ValueError(
                f"{where}: Medusa truncated_vocab_size must be an integer in [1, vocab_size], got "
                f"{truncated!r}"
            )
        scale = hf.get("logit_scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"{where}: Medusa logit_scale must be a number > 0, got {scale!r}")
        return cls(
            ints["hidden_size"],
            ints["vocab_size"],
            heads,
            layers,
            truncated,
            bool(hf.get("original_lm_head", False)),
            bool(hf.get("medusa_fc_bias", False)),
            float(scale),
        )


class ResidualBlock(nn.Module):
    def __init__(self, hidden: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(num_layers))

    # [B, H] -> [B, H]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(
            ResidualBlock(cfg.hidden_size, cfg.num_hidden_layers, cfg.fc_bias) for _ in range(cfg.num_heads)
        )
        n_heads = 1 if cfg.original_lm_head else cfg.num_heads
        self.lm_heads = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.truncated_vocab_size, bias=False) for _ in range(n_heads)
        )
        # [truncated V] draft index -> token id, when truncated
        self.register_buffer("token_map", None)

    def forward(
        self, hidden: torch.Tensor, last_tokens: torch.Tensor | None = None, k: int | None = None
    ) -> torch.Tensor:
        """hidden [B, H] -> draft token ids [B, k] from heads 0..k-1 (all by default), each head's argmax (Medusa
        drafts its top-1; the newest token is not an input of Medusa heads)."""
        heads = []
        for h, block in enumerate(self.blocks[: k or self.cfg.num_heads]):
            lm_head = self.lm_heads[0 if self.cfg.original_lm_head else h]
            # logit_scale > 0 does not move the argmax
            heads.append(lm_head(block(hidden)).argmax(dim=-1))
        # [B, num_heads]
        ids = torch.stack(heads, dim=1)
        return ids if self.token_map is None else self.token_map[ids]
