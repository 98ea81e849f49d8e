"""MLP speculator: the checkpoint format vLLM / ibm-fms use, the staged forward, and load errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import write_tiny_mlp_speculator
from verispec.loader.drafts import load_mlp_speculator


def _reference(w: dict, cfg: dict, hidden: torch.Tensor, last: torch.Tensor, k: int) -> torch.Tensor:
    """vLLM's MLPSpeculator.generate_proposals with greedy sampling, written out from its definition."""
    n, inner = cfg["n_predict"], cfg["inner_dim"]
    sw = 0.5 ** (0.5 / n)
    ew = math.sqrt((1 - sw**2) * (inner / 2))
    tied = cfg["tie_weights"]
    state = hidden
    if cfg["scale_input"]:
        state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) / 2**0.5
    token, out = last, []
    for i in range(k):
        s, p = (0, min(i, 1)) if tied else (i, i)
        z = w[f"speculator.emb.{s}.weight"][token]
        state = state @ w[f"speculator.proj.{p}.weight"].T + z * (ew / sw)
        state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6)
        state = torch.nn.functional.gelu(
            state * w[f"speculator.ln.{s}.weight"] + w[f"speculator.ln.{s}.bias"]
        )
        token = (state @ w[f"speculator.head.{s}.weight"].T).argmax(-1)
        out.append(token)
    return torch.stack(out, 1)


@pytest.mark.parametrize("tie_weights, scale_input", [(False, True), (True, False)])
def test_stages_compute_vllm_mlp_speculator(tiny_llama, tmp_path, tie_weights, scale_input):
    folder = write_tiny_mlp_speculator(
        tmp_path / "m", Path(tiny_llama), tie_weights=tie_weights, scale_input=scale_input
    )
    model = load_mlp_speculator(folder, torch.device("cpu"), torch.float32)
    w, cfg = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    hidden, last = (
        torch.randn(5, cfg["emb_dim"], generator=g),
        torch.randint(0, cfg["vocab_size"], (5,), generator=g),
    )
    for k in (1, 4):
        assert torch.equal(model(hidden, last, k), _reference(w, cfg, hidden, last, k))


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda cfg, w: (cfg, {k: v for k, v in w.items() if "head.2" not in k}),
            "'head.2.weight' is missing",
        ),
        (lambda cfg, w: (cfg, {**w, "speculator.proj.0.weight": torch.zeros(2, 2)}), "has shape"),
        (lambda cfg, w: ({**cfg, "model_type": "medusa"}, w), "not an MLP speculator checkpoint"),
        (lambda cfg, w: ({**cfg, "n_predict": 0}, w), "n_predict >= 1"),
        (lambda cfg, w: ({**cfg, "emb_dim": None}, w), "emb_dim"),
    ],
)
def test_load_errors_name_the_problem(tiny_llama, tmp_path, edit, match):
    folder = write_tiny_mlp_speculator(tmp_path / "m", Path(tiny_llama))
    cfg, w = edit(
        json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        load_mlp_speculator(folder, torch.device("cpu"), torch.float32)
