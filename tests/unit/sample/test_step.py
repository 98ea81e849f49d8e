"""sample_step's host path (the fused kernels fed from Python lists) against its tensor path: the same tokens."""

from __future__ import annotations

import random

import pytest
import torch

from verispec.kernels import ops
from verispec.request import Request
from verispec.sample import step as step_mod
from verispec.sample.metadata import SpecDecodeMetadata, VerifyRule
from verispec.sample.step import sample_step
from verispec.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not ops.verify_applies(torch.zeros(1, 8)), reason="no CPU kernels on this machine"
)

VOCAB = 300


def _case(
    seed: int, temperatures: list[float], k: int
) -> tuple[list[Request], torch.Tensor, SpecDecodeMetadata]:
    """Requests at these temperatures with 0..k drafts each, their logits rows, and drafts that the rows' argmax
    often accepts (so that steps stop at every position)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    reqs, drafts = [], []
    for i, t in enumerate(temperatures):
        out = [rng.randrange(VOCAB) for _ in range(rng.randrange(5))]
        reqs.append(Request(f"r{i}", None, [1, 2], SamplingParams(temperature=t), output_token_ids=out))
        reqs[-1].sample_key = rng.getrandbits(63)
        drafts.append(rng.randrange(k + 1))
    # [N, V] peaked rows: a few tokens carry most of the mass
    logits = torch.randn(sum(n + 1 for n in drafts), VOCAB, generator=gen) * 4.0
    top = logits.argmax(-1).tolist()
    spec, row = [], 0
    for n in drafts:
        spec.append([top[row + j] if rng.random() < 0.7 else rng.randrange(VOCAB) for j in range(n)])
        row += n + 1
    return reqs, logits, SpecDecodeMetadata(spec)


def _tensor_path(monkeypatch, reqs, logits, spec, rule):
    with monkeypatch.context() as m:
        m.setattr(step_mod, "_host_step", lambda *a, **kw: None)
        return sample_step(reqs, logits, spec, rule)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("temperatures", [[0.0], [0.0, 0.0, 0.0], [1.0], [0.7, 1.3, 0.33, 2.0], [0.9] * 5])
def test_host_path_emits_the_tensor_paths_tokens(monkeypatch, seed, temperatures):
    reqs, logits, spec = _case(seed, temperatures, k=4)
    host = step_mod._host_step(
        reqs, logits, spec.draft_token_ids, spec.max_drafts, VerifyRule(), temperatures[0] == 0
    )
    assert host is not None
    ref = _tensor_path(monkeypatch, reqs, logits, spec, VerifyRule())
    assert (host.tokens, host.num_accepted, host.row_stride) == (ref.tokens, ref.num_accepted, ref.row_stride)


def test_host_path_leaves_other_steps_to_the_tensor_path():
    reqs, logits, spec = _case(0, [0.8, 0.8], k=3)
    drafts, k = spec.draft_token_ids, spec.max_drafts
    assert step_mod._host_step(reqs, logits, drafts, k, VerifyRule("probabilistic"), False) is None
    for cut in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}):
        reqs[1].params = SamplingParams(temperature=0.8, **cut)
        assert step_mod._host_step(reqs, logits, drafts, k, VerifyRule(), False) is None
    # a GPU's or a bfloat16 step's logits: the kernels do not take them
    assert step_mod._host_step(reqs[:1], logits.bfloat16(), drafts[:1], k, VerifyRule(), False) is None
