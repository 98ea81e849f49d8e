"""DSpark's sequential stage and its confidence cut, without a model: a tiny DSparkDraft's heads on given logits."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import model_config
from verispec.models.dflash import DFlashConfig
from verispec.models.dspark import DSparkConfig, DSparkDraft, dspark_config, merged_config
from verispec.proposers.dspark import _kept

V, H, R = 40, 16, 4


def _draft(
    topk: int | None = None, confidence: bool = True, with_markov: bool = True, seed: int = 0
) -> DSparkDraft:
    cfg = model_config(hidden=H, vocab=V)
    spark = DSparkConfig(R, False, confidence, with_markov, topk)
    draft = DSparkDraft(cfg, DFlashConfig(8, (1,), False), spark, H, V)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return draft.eval()


@torch.no_grad()
def _reference(draft: DSparkDraft, hidden, base, anchor, topk=None):
    """The rule spelled out one request and one position at a time."""
    w1, w2 = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight
    proj = draft.confidence_head.proj
    drafts, conf = [], []
    for b in range(base.shape[0]):
        prev, row, crow = int(anchor[b]), [], []
        for i in range(base.shape[1]):
            m = w1[prev]
            crow.append(float(torch.sigmoid(proj(torch.cat([hidden[b, i], m])))))
            logits = base[b, i] + w2 @ m
            if topk is not None:
                keep = base[b, i].topk(topk).indices
                masked = torch.full_like(logits, float("-inf"))
                masked[keep] = logits[keep]
                logits = masked
            prev = int(logits.argmax())
            row.append(prev)
        drafts.append(row)
        conf.append(crow)
    return drafts, conf


@pytest.mark.parametrize("topk", [None, 3])
def test_sample_block_follows_the_markov_chain_rule(topk):
    draft = _draft(topk)
    g = torch.Generator().manual_seed(1)
    hidden, base = torch.randn(3, 5, H, generator=g), torch.randn(3, 5, V, generator=g)
    anchor = torch.tensor([1, 7, 30])
    drafts, conf = draft.sample_block(hidden, base, anchor)
    want, want_conf = _reference(draft, hidden, base, anchor, topk)
    assert drafts.tolist() == want
    assert conf.flatten().tolist() == pytest.approx([c for row in want_conf for c in row], rel=1e-5)
    # the bias changes the picks: without it they would be the base argmaxes
    assert drafts.tolist() != base.argmax(-1).tolist()


def test_confidence_without_the_markov_embedding_reads_the_hidden_state_alone():
    draft = _draft(with_markov=False)
    hidden, base = torch.randn(1, 2, H), torch.randn(1, 2, V)
    _, conf = draft.sample_block(hidden, base, torch.tensor([0]))
    proj = draft.confidence_head.proj
    assert conf[0].tolist() == pytest.approx(torch.sigmoid(proj(hidden[0])).squeeze(-1).tolist(), rel=1e-5)


def test_the_running_product_cuts_the_block():
    assert _kept([0.9, 0.9, 0.9], 0.0) == 3
    assert _kept([0.9, 0.9, 0.9], 0.8) == 2
    assert _kept([0.5, 1.0], 0.6) == 0
    assert _kept([], 0.5) == 0


def test_keys_are_read_from_dflash_config_then_eagle_config_then_the_top_level():
    hf = {
        "block_size": 4,
        "markov_rank": 2,
        "eagle_config": {"markov_rank": 3, "mask_token_id": 5},
        "dflash_config": {"markov_rank": 6},
    }
    merged = merged_config(hf)["dflash_config"]
    assert merged["markov_rank"] == 6 and merged["mask_token_id"] == 5 and merged["block_size"] == 4
    assert dspark_config(merged_config(hf), 10, "c").markov_rank == 6


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"markov_head_type": "gated"}, "markov_head_type='gated'"),
        ({"dspark_draft_topk": 11}, "dspark_draft_topk must be between 1 and the draft vocabulary size"),
        ({"markov_rank": -1}, "'markov_rank' must be an integer >= 0"),
    ],
)
def test_bad_settings_name_the_key(keys, message):
    with pytest.raises(ValueError, match=message):
        dspark_config(merged_config(keys), 10, "c")
