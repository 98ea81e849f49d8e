"""From target logits of scored rows to emitted tokens: plain sampling and speculative verification.

Plain decoding is the K = 0 case of the same code: the target distribution at every position is shaped by
the same sampler functions either way, which is what keeps speculation lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.engine.request import Request
from verispec.layers import sampler as S
from verispec.spec.verify import draw_uniform, entropy_thresholds, rejection_sample


@dataclass
class StepTokens:
    tokens: list[list[int]]  # per request: accepted drafts then one recovered/bonus token
    num_accepted: list[int]
    logprobs: S.Logprobs | None  # per scored row (flattened [B*(K+1)]) when any request asked
    row_stride: int  # K + 1


def _penalty_state(reqs: list[Request], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    prompt_mask = torch.zeros(len(reqs), vocab, dtype=torch.bool, device=device)  # [B, V]
    counts = torch.zeros(len(reqs), vocab, dtype=torch.long, device=device)  # [B, V]
    for i, r in enumerate(reqs):
        prompt_mask[i, torch.tensor(r.prompt_token_ids, device=device)] = True
        if r.output_token_ids:
            out = torch.tensor(r.output_token_ids, device=device)
            counts[i].index_add_(0, out, torch.ones_like(out))
    return prompt_mask, counts


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word as written (leading spaces stripped), plus its ' word' form when
    that is a different token sequence of the same length (the word in mid-text)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [ids for ids in out if ids]


def banned_by_bad_words(bad: list[list[int]], past: list[int]) -> list[int]:
    """The last token of every bad word whose other tokens end `past` (the output so far): it cannot come next."""
    banned = []
    for ids in bad:
        n = len(ids) - 1
        if n <= len(past) and (n == 0 or past[-n:] == ids[:-1]):
            banned.append(ids[-1])
    return banned


def set_token_constraints(r: Request, tokenizer, vocab: int, device) -> None:
    """r.params' bad_words, allowed_token_ids and logit_bias in the forms constrain_tokens applies (once per
    request, not per step)."""
    p = r.params
    if p.bad_words:
        r.bad_words_token_ids = bad_words_token_ids(p.bad_words, tokenizer)
    if p.allowed_token_ids is not None:
        r.disallowed = torch.ones(vocab, dtype=torch.bool, device=device)  # [V]
        r.disallowed[torch.tensor(p.allowed_token_ids, device=device)] = False
    if p.logit_bias:
        r.logit_bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=device)  # [n]
        r.logit_bias_values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=device)


def _has_constraints(r: Request) -> bool:
    return bool(r.bad_words_token_ids) or r.disallowed is not None or r.logit_bias_ids is not None


def constrain_tokens(logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]]) -> None:
    """allowed_token_ids (every other token -inf), bad_words (at verify position j the output so far includes the
    first j drafts), then logit_bias (added), at every scored position of the request, before min_tokens and the
    penalties, as vLLM orders them. logits [B, K+1, V], in place."""
    for i, r in enumerate(reqs):
        if r.bad_words_token_ids:
            for j in range(len(drafts[i]) + 1):
                banned = banned_by_bad_words(r.bad_words_token_ids, r.output_token_ids + drafts[i][:j])
                if banned:
                    logits[i, j, banned] = float("-inf")
        if r.disallowed is not None:
            logits[i].masked_fill_(r.disallowed, float("-inf"))
        if r.logit_bias_ids is not None:
            logits[i, :, r.logit_bias_ids] += r.logit_bias_values.to(logits.dtype)


def _suppress_early_stops(logits: torch.Tensor, reqs: list[Request], stride: int) -> None:
    """min_tokens: EOS and stop_token_ids cannot be sampled before min_tokens outputs. logits [B, K+1, V]."""
    for i, r in enumerate(reqs):
        left = r.params.min_tokens - len(r.output_token_ids)
        if left > 0:
            ids = list(r.params.all_stop_token_ids | (set() if r.params.ignore_eos else set(r.eos_token_ids)))
            if ids:
                logits[i, : min(left, stride), ids] = float("-inf")


def sample_step(
    reqs: list[Request],
    drafts: list[list[int]],
    logits: torch.Tensor,  # [N, V], N = sum(len(drafts[b]) + 1), rows in request order
    method: str,
    draft_probs: torch.Tensor | None,  # [B, K, V]
    default_generator: torch.Generator | None,
    synthetic_rate: float | None = None,
    block_verify: bool = False,
    entropy_verify: tuple[float, float] | None = None,  # (posterior_threshold, posterior_alpha)
) -> StepTokens:
    """Tokens to emit per request. Block Verify applies to steps verifying at least 3 drafts (vLLM Ascend's rule:
    shorter blocks gain nothing); Entropy Verify's thresholds come from the raw target logits (before penalties,
    temperature and top-k/p), as vLLM Ascend computes them."""
    b, v = len(reqs), logits.shape[-1]
    dev = logits.device
    k = max((len(d) for d in drafts), default=0)
    stride = k + 1
    n_rows = [len(d) + 1 for d in drafts]
    if k == 0 or all(n == stride for n in n_rows):
        padded = logits.view(b, stride, v)  # [B, K+1, V]
    else:  # pad ragged rows by repeating their last row (padded positions are never emitted)
        starts = torch.tensor([0] + n_rows[:-1], device=dev).cumsum(0)
        offs = torch.minimum(
            torch.arange(stride, device=dev)[None], torch.tensor(n_rows, device=dev)[:, None] - 1
        )
        padded = logits.index_select(0, (starts[:, None] + offs).reshape(-1)).view(b, stride, v)
    raw = padded
    params = [r.params for r in reqs]
    all_greedy = all(p.is_greedy for p in params)
    any_penalties = any(
        p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0 for p in params
    )
    # per-row sampling tensors only where something reads them (greedy decoding without penalties: none)
    st = None
    if any_penalties or not all_greedy:
        st = S.SamplingTensors.from_params(params, dev, v)
        st = st.repeat_interleave([stride] * b) if stride > 1 else st
    draft_t = None  # [B, K] drafted ids, -1 padded; read by verification and draft-aware penalties
    if k > 0 or any_penalties:
        padded_drafts = [d + [-1] * (k - len(d)) for d in drafts]
        draft_t = torch.tensor(padded_drafts, dtype=torch.long, device=dev).view(b, k)
    proc = padded
    if any(_has_constraints(r) for r in reqs):
        proc = proc.clone()
        constrain_tokens(proc, reqs, drafts)
    if any(p.min_tokens > 0 for p in params):
        proc = proc.clone() if proc is padded else proc
        _suppress_early_stops(proc, reqs, stride)
    flat = proc.reshape(b * stride, v)
    if any_penalties:
        mask, counts = _penalty_state(reqs, v, dev)
        counts = S.draft_aware_counts(counts, draft_t).reshape(b * stride, v)
        flat = S.apply_penalties(flat, mask.repeat_interleave(stride, 0), counts, st)
    argmax = S.greedy(flat).view(b, stride)  # [B, K+1]
    probs = noise = None
    if not all_greedy:
        probs = S.logits_to_probs(flat, st).view(b, stride, v)
        gens = [r.generator for r in reqs]
        noise = S.draw_noise([stride] * b, gens, v, dev, default_generator).view(b, stride, v)
    greedy_rows = None if all_greedy and k == 0 else torch.tensor([p.is_greedy for p in params], device=dev)
    if k == 0:
        out = argmax if probs is None else torch.where(greedy_rows[:, None], argmax, S.sample(probs, noise))
        out_list = out.view(b).tolist()  # the one host sync of the step
        tokens, accepted = [[t] for t in out_list], [0] * b
    else:
        uniform = thresholds = None
        if probs is not None and method != "strict":
            uniform = draw_uniform((b, k), [r.generator for r in reqs], dev)
            if entropy_verify is not None:
                thresholds = entropy_thresholds(raw[:, :k].float().softmax(dim=-1), *entropy_verify)  # [B, K]
        out, n_acc = rejection_sample(
            method,
            draft_t,
            probs,
            greedy_rows,
            target_argmax=argmax,
            draft_probs=draft_probs,
            uniform_samples=uniform,
            exp_noise=noise,
            synthetic_acceptance_rate=synthetic_rate,
            block=block_verify and k >= 3,
            thresholds=thresholds,
        )
        n_list = n_acc.tolist()
        rows = out.tolist()
        tokens = [row[: n + 1] for row, n in zip(rows, n_list)]
        accepted = n_list
    lp = None
    want = max((p.logprobs or 0) for p in params) if any(p.logprobs is not None for p in params) else None
    if want is not None:
        emitted = torch.tensor([t + [0] * (stride - len(t)) for t in tokens], device=dev).view(-1)
        lp = S.compute_logprobs(raw.reshape(b * stride, v), emitted, want)
    return StepTokens(tokens, accepted, lp, stride)
