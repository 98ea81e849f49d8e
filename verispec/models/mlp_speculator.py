"""MLP speculator (Wertheimer et al. 2024, "Accelerating Production LLMs with Combined Token/Embedding
Speculators", https://arxiv.org/abs/2404.19124), in the checkpoint format of vLLM and IBM's `ibm-fms` speculators.

Stage i turns a running state and the previous token into the next draft token:
  state <- GELU(LN_i(proj_i(state) + emb_i(token) * emb_weight / state_weight)),  token <- argmax(head_i(state))
starting from the target's final normed hidden state (RMS-normalised / sqrt(2) first if `scale_input`) and the
newest committed token. state_weight = 0.5 ** (0.5 / n_predict), emb_weight = sqrt((1 - state_weight^2) * inner / 2);
LN is an RMS norm with a learned scale and shift (eps 1e-6).

Checkpoint: an HF folder with config.json (`model_type: "mlp_speculator"`, `vocab_size`, `emb_dim` (the target's
hidden size), `inner_dim` (0: emb_dim), `n_predict`, `tie_weights`, `scale_input`) and safetensors `emb.{i}.weight`,
`proj.{i}.weight`, `head.{i}.weight`, `ln.{i}.weight`, `ln.{i}.bias` (an optional `speculator.` prefix is dropped);
with `tie_weights` one embedding, head and norm serve every stage and `proj.1` every stage after the first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MLPSpeculatorConfig:
    vocab_size: int
    emb_dim: int
    inner_dim: int
    n_predict: int
    tie_weights: bool = False
    scale_input: bool = False

    @classmethod
    def from_hf(cls, hf: dict, where: str) -> MLPSpeculatorConfig:
        ints = {key: hf.get(key) for key in ("vocab_size", "emb_dim", "n_predict")}
        ints["inner_dim"] = hf.get("inner_dim", 0)
        for key, value in ints.items():
            least = 0 if key == "inner_dim" else 1
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise ValueError(
                    f"{where}: MLP speculator config.json needs an integer {key} >= {least}, got {value!r}"
                )
        tie = bool(hf.get("tie_weights", False))
        if tie and ints["n_predict"] < 2:
            raise ValueError(f"{where}: tie_weights needs n_predict >= 2 (weights are tied between stages)")
        return cls(
            ints["vocab_size"],
            ints["emb_dim"],
            ints["inner_dim"] or ints["emb_dim"],
            ints["n_predict"],
            tie,
            bool(hf.get("scale_input", False)),
        )


class ScaledRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) (* weight + bias when affine)."""

    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculator(nn.Module):
    def __init__(self, cfg: MLPSpeculatorConfig):
        super().__init__()
        self.cfg = cfg
        n, inner = cfg.n_predict, cfg.inner_dim
        stages = 1 if cfg.tie_weights else n
        self.emb = nn.ModuleList(nn.Embedding(cfg.vocab_size, inner) for _ in range(stages))
        proj_in = [cfg.emb_dim] + [inner] * ((2 if cfg.tie_weights else n) - 1)
        self.proj = nn.ModuleList(nn.Linear(d, inner, bias=False) for d in proj_in)
        self.head = nn.ModuleList(nn.Linear(inner, cfg.vocab_size, bias=False) for _ in range(stages))
        self.ln = nn.ModuleList(ScaledRMSNorm(inner) for _ in range(stages))
        self.ln0 = ScaledRMSNorm(cfg.emb_dim, affine=False)
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (inner / 2))

    def forward(self, hidden: torch.Tensor, last_tokens: torch.Tensor, k: int) -> torch.Tensor:
        """hidden [B, H] (the target's state behind last_tokens [B]) -> draft token ids [B, k]."""
        # [B, H]
        state = self.ln0(hidden) / math.sqrt(2) if self.cfg.scale_input else hidden
        token, drafts = last_tokens, []
        for i in range(k):
            s = 0 if self.cfg.tie_weights else i
            proj = self.proj[min(i, 1) if self.cfg.tie_weights else i]
            # [B, inner]
            state = proj(state) + self.emb[s](token) * (self.emb_weight / self.state_weight)
            state = nn.functional.gelu(self.ln[s](state))
            # [B]
            token = self.head[s](state).argmax(dim=-1)
            drafts.append(token)
        # [B, k]
        return torch.stack(drafts, dim=1)
