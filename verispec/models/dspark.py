"""DSpark draft model (DeepSeek's semi-autoregressive drafting), Qwen3 checkpoints in the format vLLM reads.

The backbone is DFlash's (models/dflash.py): the target's streams after `target_layer_ids` fused into context keys
and values, one non-causal forward over a block. Two things differ:
- the block is the newest committed token (the anchor) followed by K - 1 noise tokens (`mask_token_id`), and every
  block position predicts the next token (the anchor's row gives draft 1); with `dspark_bonus_anchor` the block is
  DFlash's anchor + K masks, the drafts at the masks;
- a low-rank Markov head makes the drafts depend on each other: draft i is drawn from
      base_logits_i + markov_w2(markov_w1[prev_i])        prev_1 = the anchor, prev_i = draft i - 1
  left to right (one small [r] x [r, V] product per position; the backbone runs once);
- an optional confidence head estimates each draft's chance of acceptance (given the ones before it):
      c_i = sigmoid(proj(cat(h_i, markov_w1[prev_i])))    (h_i alone without `confidence_head_with_markov`)

Checkpoint: DFlash's tensors plus `markov_head.markov_w1.weight` [vocab_size, r], `markov_head.markov_w2.weight`
[draft_vocab, r], optionally `confidence_head.proj.{weight,bias}` [1, H (+ r)]; config.json keys at the top level, in
`eagle_config` or in `dflash_config` (that order of precedence reversed, as vLLM reads them): `block_size`,
`mask_token_id`, `target_layer_ids`, `markov_rank`, `markov_head_type` ("vanilla"), `enable_confidence_head`,
`confidence_head_with_markov`, `dspark_bonus_anchor`, `dspark_draft_topk` (the bias applied to the base logits'
top-k candidates only, the rest excluded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from verispec.config import ModelConfig, config_int
from verispec.layers.linear import Dense
from verispec.models.dflash import DFlashConfig, DFlashDraft

# the Markov heads this build runs (DeepSpec also trains "gated" and "rnn" ones)
MARKOV_HEAD_TYPES = ("vanilla",)
DSPARK_KEYS = (
    "block_size mask_token_id target_layer_ids num_target_layers markov_rank markov_head_type "
    "enable_confidence_head confidence_head_with_markov dspark_bonus_anchor dspark_draft_topk"
).split()


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark settings of a draft checkpoint's config.json."""

    markov_rank: int
    # the block is anchor + K masks with drafts at the masks (DFlash's layout), else anchor + K - 1 noise tokens
    bonus_anchor: bool
    confidence: bool
    confidence_with_markov: bool
    # the Markov bias only on the base logits' top-k candidates (None: on every logit)
    draft_topk: int | None


def merged_config(hf: dict) -> dict:
    """vLLM's lookup of a DSpark key: `dflash_config`, then `eagle_config`, then the top level; -> the config with
    one `dflash_config` holding every DSpark key found (what models/dflash.py reads)."""
    out = dict(hf)
    nested = {}
    for name in ("eagle_config", "dflash_config"):
        part = hf.get(name) or {}
        if not isinstance(part, dict):
            raise ValueError(f"DSpark config.json: {name} must be an object, got {type(part).__name__}")
        nested |= part
    merged = {k: hf[k] for k in DSPARK_KEYS if k in hf} | {
        k: v for k, v in nested.items() if k in DSPARK_KEYS
    }
    out["dflash_config"] = {**(hf.get("dflash_config") or {}), **merged}
    return out


def dspark_config(hf: dict, draft_vocab: int, where: str) -> DSparkConfig:
    """The DSpark settings of a merged config (merged_config); ValueError naming a key it cannot run."""
    d = hf["dflash_config"]
    kind = d.get("markov_head_type", "vanilla")
    if kind not in MARKOV_HEAD_TYPES:
        raise ValueError(
            f"{where}: markov_head_type={kind!r}: this build runs DSpark drafts with the "
            f"{', '.join(MARKOV_HEAD_TYPES)} Markov head"
        )
    rank = config_int(d.get("markov_rank", 0), "markov_rank", where, 0)
    topk = d.get("dspark_draft_topk")
    if topk is not None:
        topk = config_int(topk, "dspark_draft_topk", where, 1)
        if topk > draft_vocab:
            raise ValueError(
                f"{where}: dspark_draft_topk must be between 1 and the draft vocabulary size ({draft_vocab})"
            )
    return DSparkConfig(
        markov_rank=rank,
        bonus_anchor=bool(d.get("dspark_bonus_anchor", False)),
        confidence=bool(d.get("enable_confidence_head", False)),
        confidence_with_markov=bool(d.get("confidence_head_with_markov", False)),
        draft_topk=topk,
    )


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, draft_vocab: int, rank: int):
        super().__init__()
        # the previous token (a target id) -> [r]; [r] -> a bias over the draft vocabulary
        self.markov_w1 = nn.Embedding(vocab, rank, _weight=torch.empty(vocab, rank))
        self.markov_w2 = Dense(rank, draft_vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        # float32, as vLLM keeps it
        self.proj = nn.Linear(width, 1, bias=True)


class DSparkDraft(DFlashDraft):
    def __init__(
        self,
        cfg: ModelConfig,
        dflash: DFlashConfig,
        spark: DSparkConfig,
        fc_in: int,
        draft_vocab: int,
        own_embed: bool = False,
        own_head: bool = False,
    ):
        super().__init__(cfg, dflash, fc_in, draft_vocab, own_embed, own_head)
        self.spark = spark
        r = spark.markov_rank
        self.markov_head = MarkovHead(cfg.vocab_size, draft_vocab, r) if r else None
        width = cfg.hidden_size + (r if spark.confidence_with_markov else 0)
        self.confidence_head = ConfidenceHead(width) if spark.confidence else None

    def draft_logits(self, head_in: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, draft vocab] the base logits (before the Markov bias and the d2t map)."""
        return self._target_head(head_in) if self.lm_head is None else self.lm_head.forward(head_in)

    @torch.inference_mode()
    def sample_block(
        self, head_in: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sequential stage. head_in [B, K, H] and base [B, K, V'] at each request's K draft positions, anchor
        [B] the newest committed tokens -> (drafts [B, K] target ids, confidences [B, K] or None)."""
        b, k = base.shape[0], base.shape[1]
        prev, drafts, conf = anchor, [], []
        for i in range(k):
            # [B, r]
            m = self.markov_head.markov_w1(prev) if self.markov_head is not None else None
            if self.confidence_head is not None:
                x = (
                    head_in[:, i]
                    if m is None or not self.spark.confidence_with_markov
                    else torch.cat([head_in[:, i], m], -1)
                )
                conf.append(torch.sigmoid(self.confidence_head.proj(x.float())).squeeze(-1))
            pick = self._pick(base[:, i], m)
            prev = pick if self.d2t is None else pick + self.d2t[pick]
            drafts.append(prev)
        confidence = torch.stack(conf, dim=1) if conf else None
        return torch.stack(drafts, dim=1).view(b, k), confidence

    def _pick(self, base: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        """[B, V'] base logits + the Markov bias of m [B, r] -> [B] the argmax (draft-vocabulary ids)."""
        if m is None:
            return base.argmax(dim=-1)
        head = self.markov_head.markov_w2
        topk = self.spark.draft_topk
        if topk is None:
            return (base + head.forward(m)).argmax(dim=-1)
        # the k best base candidates, each with its bias; the others are out: [B, k]
        values, index = base.topk(topk, dim=-1)
        corrected = values + head.forward(m).gather(1, index)
        return index.gather(1, corrected.argmax(dim=-1, keepdim=True)).squeeze(1)
