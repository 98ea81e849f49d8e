"""From target logits of scored rows to emitted tokens: plain sampling and speculative verification.

Plain decoding is the K = 0 case of the same code: the target distribution at every position is shaped by
the same sampler functions either way, which is what keeps speculation lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.engine.request import Request
from verispec.sample import logits as S
from verispec.sample.constraints import constrain_tokens, has_constraints, penalty_state, suppress_early_stops
from verispec.sample.metadata import SpecDecodeMetadata, VerifyRule
from verispec.sample.verify import draw_uniform, entropy_thresholds, rejection_sample


@dataclass
class StepTokens:
    # per request: accepted drafts then one recovered / bonus token
    tokens: list[list[int]]
    num_accepted: list[int]
    # per scored row (flattened [B * (K + 1)]) when any request asked for logprobs
    logprobs: S.Logprobs | None
    # K + 1
    row_stride: int


def _pad_rows(logits: torch.Tensor, n_rows: list[int], stride: int) -> torch.Tensor:
    """logits [N, V] of ragged per-request rows -> [B, K+1, V], padding each request by repeating its last row
    (padded positions are never emitted)."""
    b, v, dev = len(n_rows), logits.shape[-1], logits.device
    if all(n == stride for n in n_rows):
        return logits.view(b, stride, v)
    starts = torch.tensor([0] + n_rows[:-1], device=dev).cumsum(0)
    offs = torch.minimum(
        torch.arange(stride, device=dev)[None], torch.tensor(n_rows, device=dev)[:, None] - 1
    )
    return logits.index_select(0, (starts[:, None] + offs).reshape(-1)).view(b, stride, v)


def _processed(raw: torch.Tensor, reqs: list[Request], drafts: list[list[int]]) -> torch.Tensor:
    """raw [B, K+1, V] with the requests' token constraints and min_tokens applied (a copy when any apply)."""
    proc = raw
    if any(has_constraints(r) for r in reqs):
        proc = proc.clone()
        constrain_tokens(proc, reqs, drafts)
    if any(r.params.min_tokens > 0 for r in reqs):
        proc = proc.clone() if proc is raw else proc
        suppress_early_stops(proc, reqs, raw.shape[1])
    return proc


def sample_step(
    reqs: list[Request],
    logits: torch.Tensor,
    spec: SpecDecodeMetadata,
    rule: VerifyRule,
    default_generator: torch.Generator | None,
) -> StepTokens:
    """Tokens to emit per request. logits [N, V]: N = sum(len(drafts[b]) + 1) rows in request order. Block Verify
    applies to steps verifying at least 3 drafts (vLLM Ascend's rule: shorter blocks gain nothing); Entropy
    Verify's thresholds come from the raw target logits (before penalties, temperature and top-k/p), as vLLM
    Ascend computes them."""
    drafts = spec.draft_token_ids
    b, v, dev = len(reqs), logits.shape[-1], logits.device
    k = spec.max_drafts
    stride = k + 1
    raw = _pad_rows(logits, [len(d) + 1 for d in drafts], stride)
    params = [r.params for r in reqs]
    all_greedy = all(p.is_greedy for p in params)
    any_penalties = any(p.has_penalties for p in params)
    # per-row sampling tensors only where something reads them (greedy decoding without penalties: none)
    st = None
    if any_penalties or not all_greedy:
        st = S.SamplingTensors.from_params(params, dev, v)
        st = st.repeat_interleave([stride] * b) if stride > 1 else st
    # [B, K] drafted ids, -1 padded; read by verification and draft-aware penalties
    draft_t = None
    if k > 0 or any_penalties:
        padded_drafts = [d + [-1] * (k - len(d)) for d in drafts]
        draft_t = torch.tensor(padded_drafts, dtype=torch.long, device=dev).view(b, k)
    flat = _processed(raw, reqs, drafts).reshape(b * stride, v)
    if any_penalties:
        mask, counts = penalty_state(reqs, v, dev)
        counts = S.draft_aware_counts(counts, draft_t).reshape(b * stride, v)
        flat = S.apply_penalties(flat, mask.repeat_interleave(stride, 0), counts, st)
    # [B, K+1]
    argmax = S.greedy(flat).view(b, stride)
    probs = sample_u = None
    if not all_greedy:
        probs = S.logits_to_probs(flat, st).view(b, stride, v)
        gens = [r.generator for r in reqs]
        # [B, K+1] one uniform per position for its sample
        sample_u = S.draw_row_uniforms([stride] * b, gens, dev, default_generator).view(b, stride)
    # [B] bool, or None when no row is random and nothing is verified
    greedy_rows = None if all_greedy and k == 0 else torch.tensor([p.is_greedy for p in params], device=dev)
    if k == 0:
        out = S.greedy_or_sample(
            argmax.view(b),
            None if probs is None else probs.view(b, v),
            None if sample_u is None else sample_u.view(b),
            greedy_rows,
        )
        # the one host sync of the step
        tokens, accepted = [[t] for t in out.tolist()], [0] * b
    else:
        tokens, accepted = _verify(raw, draft_t, probs, sample_u, argmax, greedy_rows, spec, rule, reqs)
    lp = None
    if any(p.logprobs is not None for p in params):
        want = max((p.logprobs or 0) for p in params)
        emitted = torch.tensor([t + [0] * (stride - len(t)) for t in tokens], device=dev).view(-1)
        lp = S.compute_logprobs(raw.reshape(b * stride, v), emitted, want)
    return StepTokens(tokens, accepted, lp, stride)


def _verify(raw, draft_t, probs, sample_u, argmax, greedy_rows, spec, rule, reqs) -> tuple[list, list]:
    """Run the rule over the drafts; -> (tokens per request, accepted drafts per request)."""
    b, k = draft_t.shape
    uniform = thresholds = None
    if probs is not None and rule.draws_uniform:
        uniform = draw_uniform((b, k), [r.generator for r in reqs], draft_t.device)
        if rule.entropy is not None:
            # [B, K]
            thresholds = entropy_thresholds(raw[:, :k].float().softmax(dim=-1), *rule.entropy)
    out, n_acc = rejection_sample(
        rule.method,
        draft_t,
        probs,
        greedy_rows,
        target_argmax=argmax,
        draft_probs=spec.draft_probs,
        uniform_samples=uniform,
        sample_u=sample_u,
        synthetic_acceptance_rate=rule.synthetic_acceptance_rate,
        block=rule.block and k >= 3,
        thresholds=thresholds,
    )
    n_list = n_acc.tolist()
    return [row[: n + 1] for row, n in zip(out.tolist(), n_list)], n_list
