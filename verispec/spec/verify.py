"""Rejection sampling for speculative decoding, as pure tensor functions.

Conventions (B = batch rows, K = max drafts per row, V = vocab):

- ``draft_token_ids`` ``[B, K]`` int64, padded with -1. Row b's valid drafts are the first
  ``num_draft[b]`` entries (0..K); ``num_draft`` is derived from the padding.
- ``target_probs`` ``[B, K+1, V]``: the target distribution after all sampling transforms
  (temperature, top-k/top-p/min-p, penalties). Position j scores the token following draft
  j-1; position 0 follows the last committed token.
- ``draft_probs`` ``[B, K, V]`` or None. None means a draft-free proposer (n-gram, ...): q is
  one-hot at the draft token.
- Output ``output_token_ids`` ``[B, K+1]`` padded with -1: the accepted drafts then exactly
  one more token (recovered at the first rejection, or the bonus token when every draft of
  the row was accepted). ``num_accepted`` ``[B]``; a row emits ``num_accepted + 1`` tokens.

Randomness is an input, never drawn here, so the caller decides seeding per request:

- ``uniform_samples`` ``[B, K]`` in [0, 1): acceptance tests (``probabilistic``, ``synthetic``).
- ``exp_noise`` ``[B, K+1, V]`` i.i.d. Exp(1), strictly positive: every categorical sample
  is an "exponential race", ``argmax(p / noise)``, which is an exact sample of
  ``p / p.sum()`` (p need not be normalised).

``draw_uniform`` / ``draw_exp_noise`` build these tensors, drawing each row that has a
``torch.Generator`` from that generator (one loop step per seeded request, not per token).

No function here syncs with the host (.item(), .tolist(), data-dependent Python branches).
"""

from collections.abc import Sequence

import torch

METHODS = ("strict", "probabilistic", "synthetic")


# ---------------------------------------------------------------------------- randomness


def draw_uniform(
    shape: Sequence[int],
    generators: Sequence[torch.Generator | None] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """U[0, 1) tensor of ``shape`` (first dim = rows); row i uses ``generators[i]`` if set."""
    out = torch.rand(*shape, device=device, dtype=dtype)
    if generators is not None:
        for i, gen in enumerate(generators):
            if gen is not None:
                out[i].uniform_(generator=gen)
    return out


def draw_exp_noise(
    shape: Sequence[int],
    generators: Sequence[torch.Generator | None] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Exp(1) noise of ``shape`` (first dim = rows), clamped > 0; row i uses ``generators[i]``."""
    out = torch.empty(*shape, device=device, dtype=dtype).exponential_()
    if generators is not None:
        for i, gen in enumerate(generators):
            if gen is not None:
                out[i].exponential_(generator=gen)
    return out.clamp_min_(torch.finfo(dtype).tiny)  # 0 noise would make 0/0 = nan


def exponential_race(probs: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """Sample one token per distribution: ``argmax(probs / noise)``. [..., V] -> [...]."""
    return (probs / exp_noise).argmax(dim=-1)


# ---------------------------------------------------------------------------- helpers


def _assemble(
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 padded
    accept: torch.Tensor,  # [B, K] bool, per-position acceptance (ignored where padded)
    next_tokens: torch.Tensor,  # [B, K+1] token to emit if the first rejection is at j
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted prefix + one token from ``next_tokens`` at position ``num_accepted``."""
    B, K = draft_token_ids.shape
    valid = draft_token_ids >= 0  # [B, K]
    num_accepted = (accept & valid).long().cumprod(dim=1).sum(dim=1)  # [B]
    pos = torch.arange(K + 1, device=draft_token_ids.device)  # [K+1]
    pad = torch.full((B, 1), -1, dtype=draft_token_ids.dtype, device=draft_token_ids.device)
    drafts = torch.cat([draft_token_ids, pad], dim=1)  # [B, K+1]
    na = num_accepted[:, None]  # [B, 1]
    out = torch.where(pos < na, drafts, torch.where(pos == na, next_tokens.to(drafts.dtype), -1))
    return out, num_accepted  # [B, K+1], [B]


def _draft_index(draft_token_ids: torch.Tensor) -> torch.Tensor:
    return draft_token_ids.clamp_min(0)[..., None]  # [B, K, 1], padding -> token 0 (masked later)


# ---------------------------------------------------------------------------- methods


def greedy_verify(
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 padded
    target_argmax: torch.Tensor,  # [B, K+1] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while draft == target argmax; then emit the target argmax."""
    K = draft_token_ids.shape[1]
    accept = draft_token_ids == target_argmax[:, :K]  # [B, K]
    return _assemble(draft_token_ids, accept, target_argmax)


def strict_verify(
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 padded
    target_probs: torch.Tensor,  # [B, K+1, V]
    exp_noise: torch.Tensor,  # [B, K+1, V] Exp(1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample the target at every position; accept while the sample equals the draft.

    Exactly lossless: every emitted token (accepted draft, replacement, bonus) is the
    target's own sample at its position. Ignores draft probabilities.
    """
    K = draft_token_ids.shape[1]
    samples = exponential_race(target_probs, exp_noise)  # [B, K+1]
    accept = draft_token_ids == samples[:, :K]  # [B, K]
    return _assemble(draft_token_ids, accept, samples)


def probabilistic_verify(
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 padded
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_probs: torch.Tensor | None,  # [B, K, V], None = one-hot q at the draft
    uniform_samples: torch.Tensor,  # [B, K] U[0, 1)
    exp_noise: torch.Tensor,  # [B, K+1, V] Exp(1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. / Chen et al. speculative sampling (lossless).

    Accept x_j with prob min(1, p(x_j) / q(x_j)); at the first rejection emit a sample of
    normalize(max(p - q, 0)) (p if that is all zero); after the last draft emit a bonus
    sample of p at position num_draft.
    """
    K = draft_token_ids.shape[1]
    idx = _draft_index(draft_token_ids)  # [B, K, 1]
    valid = (draft_token_ids >= 0)[..., None]  # [B, K, 1]
    p_draft = target_probs[:, :K].gather(-1, idx)  # [B, K, 1]
    residual = target_probs.clone()  # [B, K+1, V]; position K and padded positions stay p
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)  # [B, K, 1]
        # q one-hot: residual is p with the draft token zeroed (padded positions untouched)
        residual[:, :K].scatter_(-1, idx, torch.where(valid, 0.0, p_draft).to(residual.dtype))
    else:
        q_draft = draft_probs.gather(-1, idx)  # [B, K, 1]
        residual[:, :K] -= draft_probs * valid
        residual.clamp_min_(0.0)
    accept = (uniform_samples[..., None] * q_draft < p_draft).squeeze(-1)  # [B, K]
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # [B, K+1, 1]
    residual = torch.where(empty, target_probs, residual)  # [B, K+1, V] unnormalised is fine
    next_tokens = exponential_race(residual, exp_noise)  # [B, K+1]
    return _assemble(draft_token_ids, accept, next_tokens)


def synthetic_verify(
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 padded
    target_probs: torch.Tensor,  # [B, K+1, V]
    uniform_samples: torch.Tensor,  # [B, K] U[0, 1)
    exp_noise: torch.Tensor,  # [B, K+1, V] Exp(1)
    acceptance_rate: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept each draft independently with prob ``acceptance_rate``; stop at first rejection.

    NOT lossless: the output distribution is not the target's. For benchmarking the engine
    at a controlled acceptance rate only. Recovered/bonus tokens are samples of p.
    """
    accept = uniform_samples < acceptance_rate  # [B, K]
    return _assemble(draft_token_ids, accept, exponential_race(target_probs, exp_noise))


# ---------------------------------------------------------------------------- dispatcher


def rejection_sample(
    method: str,
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 padded
    target_probs: torch.Tensor | None,  # [B, K+1, V], may be None if every row is greedy
    is_greedy: torch.Tensor | None = None,  # [B] bool; None = every row random
    *,
    target_argmax: torch.Tensor | None = None,  # [B, K+1]; default target_probs.argmax(-1)
    draft_probs: torch.Tensor | None = None,  # [B, K, V]; None = draft-free (one-hot q)
    uniform_samples: torch.Tensor | None = None,  # [B, K]; probabilistic / synthetic
    exp_noise: torch.Tensor | None = None,  # [B, K+1, V]; None = every row greedy
    synthetic_acceptance_rate: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch mixing greedy and random rows. Returns ``(output_token_ids [B, K+1],
    num_accepted [B])``.

    Greedy rows (``is_greedy``) always use the greedy rule, whatever ``method`` is; random
    rows use ``method`` (``strict`` | ``probabilistic`` | ``synthetic``). Which paths run is
    decided from which inputs are None, never from tensor values (no host sync):
    ``exp_noise=None`` means no random rows, ``is_greedy=None`` means no greedy rows. When
    both run, the result is selected per row, so random inputs of greedy rows are ignored.
    """
    if method not in METHODS:
        raise ValueError(f"unknown rejection sampling method {method!r}; expected one of {METHODS}")
    if exp_noise is None and is_greedy is None:
        raise ValueError("exp_noise is required unless every row is greedy (pass is_greedy)")

    greedy = None
    if is_greedy is not None:
        if target_argmax is None:
            if target_probs is None:
                raise ValueError("greedy rows need target_argmax or target_probs")
            target_argmax = target_probs.argmax(dim=-1)  # [B, K+1]
        greedy = greedy_verify(draft_token_ids, target_argmax)
        if exp_noise is None:
            return greedy

    if target_probs is None:
        raise ValueError("random rows need target_probs")
    if method == "strict":
        rand = strict_verify(draft_token_ids, target_probs, exp_noise)
    else:
        if uniform_samples is None:
            raise ValueError(f"method {method!r} needs uniform_samples")
        if method == "probabilistic":
            rand = probabilistic_verify(
                draft_token_ids, target_probs, draft_probs, uniform_samples, exp_noise
            )
        else:
            if synthetic_acceptance_rate is None:
                raise ValueError("method 'synthetic' needs synthetic_acceptance_rate")
            rand = synthetic_verify(
                draft_token_ids, target_probs, uniform_samples, exp_noise, synthetic_acceptance_rate
            )
    if greedy is None:
        return rand
    out = torch.where(is_greedy[:, None], greedy[0], rand[0])  # [B, K+1]
    num_accepted = torch.where(is_greedy, greedy[1], rand[1])  # [B]
    return out, num_accepted
