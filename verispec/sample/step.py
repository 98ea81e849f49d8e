"""From target logits of scored rows to emitted tokens: plain sampling and speculative verification.

Plain decoding is the K = 0 case of the same code: the target distribution at every position is shaped by
the same sampler functions either way, which is what keeps speculation lossless.
"""

from __future__ import annotations

import torch

from verispec.kernels import ops
from verispec.request import Request
from verispec.sample import logits as S
from verispec.sample.constraints import constrain_tokens, has_constraints, penalty_state, suppress_early_stops
from verispec.sample.logits import position_uniforms_of
from verispec.sample.metadata import SpecDecodeMetadata, StepTokens, VerifyRule
from verispec.sample.tree_verify import verify_tree
from verispec.sample.verify import (
    draw_uniform,
    entropy_thresholds,
    greedy_verify,
    rejection_sample,
)
from verispec.sampling_params import SamplingParams


def _row_map(n_rows: list[int], stride: int, dev: torch.device) -> torch.Tensor:
    """[B, K+1] int64: the row of the step's ragged logits [N, V] scoring each request's position; a request's
    last row repeats as its padding (padded positions are never emitted)."""
    b = len(n_rows)
    if all(n == stride for n in n_rows):
        return torch.arange(b * stride, device=dev).view(b, stride)
    starts = torch.tensor([0] + n_rows[:-1], device=dev).cumsum(0)
    offs = torch.minimum(
        torch.arange(stride, device=dev)[None], torch.tensor(n_rows, device=dev)[:, None] - 1
    )
    return starts[:, None] + offs


def _pad_rows(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [N, V] of ragged per-request rows -> [B, K+1, V] (a view when no request is short)."""
    b, stride = rows.shape
    if logits.shape[0] == rows.numel():
        return logits.view(b, stride, logits.shape[-1])
    return logits.index_select(0, rows.view(-1)).view(b, stride, logits.shape[-1])


def _processed(
    raw: torch.Tensor,
    reqs: list[Request],
    drafts: list[list[int]],
    draft_t: torch.Tensor,
    st: S.SamplingTensors | None,
) -> torch.Tensor:
    """raw [B, K+1, V] -> [B * (K+1), V] with the requests' token constraints and min_tokens applied, then (st
    given) their penalties, counting the drafts before each position (a copy when any apply)."""
    proc = raw
    if any(has_constraints(r) for r in reqs):
        proc = proc.clone()
        constrain_tokens(proc, reqs, drafts)
    if any(r.params.min_tokens > 0 for r in reqs):
        proc = proc.clone() if proc is raw else proc
        suppress_early_stops(proc, reqs, raw.shape[1])
    b, stride, v = raw.shape
    proc = proc.reshape(b * stride, v)
    if st is None:
        return proc
    mask, counts = penalty_state(reqs, v, raw.device)
    counts = S.draft_aware_counts(counts, draft_t).reshape(b * stride, v)
    per_row = st.repeat_interleave([stride] * b) if stride > 1 else st
    return S.apply_penalties(proc, mask.repeat_interleave(stride, 0), counts, per_row)


def sample_step(
    reqs: list[Request],
    logits: torch.Tensor,
    spec: SpecDecodeMetadata,
    rule: VerifyRule,
    generator: torch.Generator | None = None,
) -> StepTokens:
    """Tokens to emit per request: the one entry for plain decoding (no drafts), chains and trees (spec.tree;
    `generator` draws a tree's bonus uniforms for requests without a seed). logits [N, V]: N = sum(len(drafts[b])
    + 1) rows in request order. Block Verify applies to steps verifying at least 3 drafts (vLLM Ascend's rule);
    Entropy Verify's thresholds come from the raw target logits (before penalties, temperature and top-k/p)."""
    if spec.tree is not None:
        return verify_tree(reqs, logits, spec, rule, generator)
    drafts = spec.draft_token_ids
    b, v, dev = len(reqs), logits.shape[-1], logits.device
    k = spec.max_drafts
    stride = k + 1
    params = [r.params for r in reqs]
    all_greedy = all(p.is_greedy for p in params)
    any_greedy = any(p.is_greedy for p in params)
    any_penalties = any(p.has_penalties for p in params)
    want_logprobs = any(p.logprobs is not None for p in params)
    processed = any_penalties or any(has_constraints(r) or r.params.min_tokens > 0 for r in reqs)
    if all_greedy and k == 0 and not processed and not want_logprobs:
        # plain greedy decoding: each row's argmax, one host sync
        return StepTokens([[t] for t in S.greedy(logits).tolist()], [0] * b, None, 1)
    if not processed and not want_logprobs and any_greedy == all_greedy:
        host = _host_step(reqs, logits, drafts, k, rule, all_greedy)
        if host is not None:
            return host
    n_rows = [len(d) + 1 for d in drafts]
    # [B, K+1]
    rows = _row_map(n_rows, stride, dev)
    entropy = rule.entropy is not None and not all_greedy and k > 0
    # [B, K+1, V] the raw rows padded per request, only where something reads them in that shape
    raw = _pad_rows(logits, rows) if processed or want_logprobs or entropy else None
    # per-request sampling tensors only where something reads them (greedy decoding without penalties: none)
    st = S.SamplingTensors.from_params(params, dev, v) if any_penalties or not all_greedy else None
    # [B, K] drafted ids, -1 padded; read by verification, sampling and draft-aware penalties
    padded_drafts = [d + [-1] * (k - len(d)) for d in drafts]
    draft_t = torch.tensor(padded_drafts, dtype=torch.long, device=dev).view(b, k)
    # the logits the rules read and the row of each position in them: the step's own rows when nothing
    # reshapes them, else a processed [B * (K+1), V] copy
    src, src_rows = logits, rows
    if processed:
        src = _processed(raw, reqs, drafts, draft_t, st if any_penalties else None)
        src_rows = torch.arange(b * stride, device=dev).view(b, stride)
    # ([B], [B]) the greedy rule's emitted token and accepted count, for the greedy rows
    greedy = _greedy(src, src_rows, draft_t) if any_greedy else None
    if all_greedy:
        out = greedy
    else:
        gens = [r.generator for r in reqs]
        # [B, K+1] the uniform of each scored position's sample
        sample_u = position_uniforms_of(reqs, torch.arange(stride, device=dev))
        uniform = thresholds = None
        if k > 0 and rule.draws_uniform:
            uniform = draw_uniform((b, k), gens, dev)
            if entropy:
                # [B, K]
                thresholds = entropy_thresholds(raw[:, :k].float().softmax(dim=-1), *rule.entropy)
        out = _fused(src, src_rows, draft_t, st, spec, rule, uniform, thresholds, sample_u)
        if out is None:
            probs = S.logits_to_probs(
                src.index_select(0, src_rows.view(-1)), st.repeat_interleave([stride] * b)
            )
            out = _emitted(
                _dense(probs.view(b, stride, v), draft_t, sample_u, uniform, thresholds, spec, rule)
            )
        if any_greedy:
            # [B] bool
            greedy_rows = torch.tensor([p.is_greedy for p in params], device=dev)
            out = (torch.where(greedy_rows, greedy[0], out[0]), torch.where(greedy_rows, greedy[1], out[1]))
    tokens, accepted = _finish(drafts, *out)
    lp = None
    if want_logprobs:
        want = max((p.logprobs or 0) for p in params)
        emitted = torch.tensor([t + [0] * (stride - len(t)) for t in tokens], device=dev).view(-1)
        lp = S.compute_logprobs(raw.reshape(b * stride, v), emitted, want)
    return StepTokens(tokens, accepted, lp, stride)


def _host_step(
    reqs: list[Request], logits: torch.Tensor, drafts: list[list[int]], k: int, rule: VerifyRule, greedy: bool
) -> StepTokens | None:
    """The common CPU step, where nothing reshapes the logits (no penalties, constraints or logprobs; all rows
    greedy, or all random under the strict rule without top-k / top-p / min-p): the fused verification kernels fed
    from Python lists. The same kernels and inputs as the tensor path, so the same tokens, without its small torch
    ops (right after a forward has streamed the weights through the caches, each costs tens of microseconds). None
    where it does not apply."""
    v, stride, b = logits.shape[-1], k + 1, len(reqs)
    params = [r.params for r in reqs]
    if not greedy and ((k and rule.method != "strict") or any(_truncates(p, v) for p in params)):
        return None
    # [B * (K+1)] each position's row in logits (a request's last row repeats as its padding), [B * K] drafts
    rows: list[int] = []
    flat: list[int] = []
    start = 0
    for d in drafts:
        rows.extend(start + min(j, len(d)) for j in range(stride))
        flat.extend(d + [-1] * (k - len(d)))
        start += len(d) + 1
    if greedy:
        out = ops.verify_greedy_host(logits, rows, flat, b, k)
    else:
        # [B * (K+1)] the uniform of each position's sample (position_uniforms_of)
        u = [
            S.position_uniform(r.sample_key, len(r.output_token_ids) + j) for r in reqs for j in range(stride)
        ]
        out = ops.verify_sampled_host(logits, rows, flat, [p.temperature for p in params], u, b, k)
    if out is None:
        return None
    tokens, accepted = out
    return StepTokens([d[:n] + [t] for d, n, t in zip(drafts, accepted, tokens)], accepted, None, stride)


def _truncates(p: SamplingParams, vocab_size: int) -> bool:
    """Whether top-k, top-p or min-p cut this request's distribution (SamplingTensors.from_params' any_*)."""
    return 0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0


def _fused(src, src_rows, draft_t, st, spec, rule, uniform, thresholds, sample_u):
    """The rules that need one row per position scored only up to the first rejection (strict, and
    probabilistic against a one-hot draft distribution) run in the fused CPU kernel, straight from the logits;
    -> (emitted token [B], num_accepted [B]), or None where the kernel does not apply (min-p, Block
    Verify, draft probabilities, synthetic, not CPU float32)."""
    k = draft_t.shape[1]
    strict = k == 0 or rule.method == "strict"
    probabilistic = (
        rule.method == "probabilistic" and not (rule.block and k >= 3) and spec.draft_probs is None
    )
    if st.any_min_p or not (strict or probabilistic) or not ops.verify_applies(src):
        return None
    # [B]
    scale = 1.0 / st.temperature
    if st.any_top_k or st.any_top_p:
        # truncation reads the tempered logits of every position
        b, stride = src_rows.shape
        per_row = st.repeat_interleave([stride] * b)
        src = src.index_select(0, src_rows.view(-1)) / per_row.temperature[:, None]
        src = S.apply_top_k_top_p(
            src, per_row.top_k if st.any_top_k else None, per_row.top_p if st.any_top_p else None
        )
        src_rows, scale = torch.arange(b * stride, device=src.device).view(b, stride), torch.ones_like(scale)
    u_accept = None if strict else (uniform if thresholds is None else uniform * thresholds)
    return ops.verify_sampled(src, src_rows, draft_t, scale, u_accept, sample_u)


def _dense(probs, draft_t, sample_u, uniform, thresholds, spec, rule):
    """Every other rule, over the full target distribution of every position: probs [B, K+1, V]."""
    k = draft_t.shape[1]
    return rejection_sample(
        rule.method if k > 0 else "strict",
        draft_t,
        probs,
        draft_probs=spec.draft_probs,
        uniform_samples=uniform,
        sample_u=sample_u,
        synthetic_acceptance_rate=rule.synthetic_acceptance_rate,
        block=rule.block and k >= 3,
        thresholds=thresholds,
    )


def _greedy(
    src: torch.Tensor, src_rows: torch.Tensor, draft_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification -> (emitted token [B], num_accepted [B]): the fused CPU kernel (argmax of only the rows
    a request reaches) where it applies, else the argmax of every row and the tensor rule."""
    fused = ops.verify_greedy(src, src_rows, draft_t)
    if fused is not None:
        return fused
    return _emitted(greedy_verify(draft_t, S.greedy(src)[src_rows]))


def _emitted(out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output_token_ids [B, K+1], num_accepted [B]) -> (the token emitted after the accepted drafts [B],
    num_accepted [B]): the accepted drafts are the drafts' own prefix, so the rest says nothing more."""
    return out[0].gather(1, out[1][:, None]).squeeze(1), out[1]


def _finish(
    drafts: list[list[int]], token: torch.Tensor, num_accepted: torch.Tensor
) -> tuple[list[list[int]], list[int]]:
    """The emitted token [B] and num_accepted [B] -> per request its emitted tokens (accepted drafts, then that
    token) and accepted count: the one host sync of the step."""
    tokens, accepted = torch.stack([token, num_accepted.to(token.dtype)]).tolist()
    return [d[:n] + [t] for d, n, t in zip(drafts, accepted, tokens)], accepted
