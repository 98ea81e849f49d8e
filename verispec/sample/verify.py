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

- ``uniform_samples`` ``[B, K]`` in [0, 1): acceptance tests (``probabilistic``, ``synthetic``, block).
- ``exp_noise`` ``[B, K+1, V]`` i.i.d. Exp(1), strictly positive: every categorical sample
  is an "exponential race", ``argmax(p / noise)``, which is an exact sample of
  ``p / p.sum()`` (p need not be normalised).

``draw_uniform`` / ``draw_exp_noise`` build these tensors, drawing each row that has a
``torch.Generator`` from that generator (one loop step per seeded request, not per token).

Options of ``probabilistic`` (vLLM Ascend's ``rejection_sampler_config``):

- Block Verify (``block=True``): Sun et al. 2024, "Block Verification Accelerates Speculative Decoding",
  Algorithm 2. The drafts are judged as a block through cumulative ratios, the accepted prefix is the *last*
  position whose test passes (not the first failure), and the replacement comes from a residual scaled by the
  cumulative ratio. Still exactly lossless; accepts at least as many tokens in expectation.
- Entropy Verify (``thresholds``): the acceptance test becomes ``u * t < p / q`` with
  ``t = min(exp(-alpha * H), posterior_threshold)`` per position (``entropy_thresholds``): uncertain positions
  accept more. NOT lossless by design (a quality/speed trade-off, as vLLM Ascend documents).

No function here syncs with the host (.item(), .tolist(), data-dependent Python branches).
"""

import functools
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
    """Accepted prefix (up to the first rejection) + one token from ``next_tokens`` at ``num_accepted``."""
    valid = draft_token_ids >= 0  # [B, K]
    num_accepted = (accept & valid).long().cumprod(dim=1).sum(dim=1)  # [B]
    return _assemble_at(draft_token_ids, num_accepted, next_tokens)


def _assemble_at(
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 padded
    num_accepted: torch.Tensor,  # [B] accepted prefix length
    next_tokens: torch.Tensor,  # [B, K+1] (or broadcastable) token to emit at position num_accepted
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [0, num_accepted), then ``next_tokens[num_accepted]``, then -1 padding. -> ([B, K+1], [B])."""
    B, K = draft_token_ids.shape
    pos = torch.arange(K + 1, device=draft_token_ids.device)  # [K+1]
    pad = torch.full((B, 1), -1, dtype=draft_token_ids.dtype, device=draft_token_ids.device)
    drafts = torch.cat([draft_token_ids, pad], dim=1)  # [B, K+1]
    na = num_accepted[:, None]  # [B, 1]
    out = torch.where(pos < na, drafts, torch.where(pos == na, next_tokens.to(drafts.dtype), -1))
    return out, num_accepted


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
    thresholds: torch.Tensor | None = None,  # [B, K] Entropy Verify; None = 1 (lossless)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. / Chen et al. speculative sampling (lossless).

    Accept x_j with prob min(1, p(x_j) / q(x_j)) (with ``thresholds``: min(1, p / (q t))); at the first
    rejection emit a sample of normalize(max(p - q, 0)) (p if that is all zero); after the last draft emit a
    bonus sample of p at position num_draft.
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
    u = uniform_samples if thresholds is None else uniform_samples * thresholds  # [B, K]
    accept = (u[..., None] * q_draft < p_draft).squeeze(-1)  # [B, K]
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # [B, K+1, 1]
    residual = torch.where(empty, target_probs, residual)  # [B, K+1, V] unnormalised is fine
    next_tokens = exponential_race(residual, exp_noise)  # [B, K+1]
    return _assemble(draft_token_ids, accept, next_tokens)


def block_verify(
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 padded
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_probs: torch.Tensor | None,  # [B, K, V], None = one-hot q at the draft
    uniform_samples: torch.Tensor,  # [B, K] U[0, 1)
    exp_noise: torch.Tensor,  # [B, K+1, V] Exp(1)
    thresholds: torch.Tensor | None = None,  # [B, K] Entropy Verify; None = 1 (lossless)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification (Sun et al. 2024, Algorithm 2), lossless.

    With x_i the drafts (i = 1..g, g = the row's draft count), p, q the target and draft distributions:
      w_0 = 1, w_i = min(1, w_{i-1} p(x_i) / q(x_i))          cumulative ratio
      Z_i = sum_x max(w_i p_i(x) - q_i(x), 0)                  residual mass after x_1..x_i
      h_i = Z_i / (Z_i + 1 - w_i) for i < g, h_g = w_g        acceptance probability of the block up to i
    tau = the largest i with u_i <= h_i (0 if none): x_1..x_tau are accepted, then one token is drawn from
    max(w_tau p_tau - q_tau, 0) (p_g itself when tau = g: the bonus token).
    """
    B, K = draft_token_ids.shape
    dev = draft_token_ids.device
    idx = _draft_index(draft_token_ids)  # [B, K, 1]
    valid = draft_token_ids >= 0  # [B, K]; a row's drafts are a prefix
    p_x = target_probs[:, :K].gather(-1, idx).squeeze(-1)  # [B, K]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, idx).squeeze(-1)
    tiny = torch.finfo(p_x.dtype).tiny
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(tiny), (p_x > 0).to(p_x.dtype))  # [B, K]
    ratio = torch.where(valid, ratio, 1.0)
    # w_i = min(1, w_{i-1} r_i) is a random walk in log space reflected at 0: log w_i = S_i - max(0, max_j<=i S_j)
    s = ratio.log().cumsum(dim=1)  # [B, K]
    w = (s - s.cummax(dim=1).values.clamp_min(0.0)).exp()  # [B, K] w_1..w_K
    w0 = torch.cat([torch.ones(B, 1, dtype=w.dtype, device=dev), w], dim=1)  # [B, K+1] w_0..w_K
    residual = w0[..., None] * target_probs  # [B, K+1, V]: row i is max(w_i p_i - q_i, 0) once q is taken off
    if draft_probs is None:
        sub = torch.where(valid, 1.0, 0.0).to(residual.dtype)[..., None]  # [B, K, 1] one-hot q at the draft
        residual[:, :K].scatter_add_(-1, idx, -sub)
    else:
        residual[:, :K] -= draft_probs * valid[..., None]
    residual.clamp_min_(0.0)
    z = residual.sum(dim=-1)  # [B, K+1]; z[:, i] = Z_i
    zi = z[:, 1:]  # [B, K], i = 1..K
    denom = zi + 1.0 - w
    h = torch.where(denom > 0, zi / denom.clamp_min(tiny), 1.0)  # [B, K]
    pos = torch.arange(1, K + 1, device=dev)  # [K]
    last = valid.sum(dim=1, keepdim=True)  # [B, 1] draft count g
    h = torch.where(pos == last, w, h)
    u = uniform_samples if thresholds is None else uniform_samples * thresholds
    passed = valid & (u <= h)  # [B, K]
    tau = (passed * pos).amax(dim=1)  # [B]
    rows = torch.arange(B, device=dev)
    res_tau = residual[rows, tau]  # [B, V]
    empty = res_tau.sum(dim=-1, keepdim=True) <= 0  # [B, 1]
    res_tau = torch.where(empty, target_probs[rows, tau], res_tau)
    final = exponential_race(res_tau, exp_noise[rows, tau])  # [B]
    return _assemble_at(draft_token_ids, tau, final[:, None])


def entropy_thresholds(
    probs: torch.Tensor,  # [B, K, V] target distributions the drafts are verified against (before sampling transforms)
    posterior_threshold: float,
    posterior_alpha: float,
) -> torch.Tensor:
    """Entropy Verify's per-position threshold min(exp(-alpha * H(p)), posterior_threshold), H in nats
    (vLLM Ascend's rejection_sampler_config). -> [B, K]."""
    entropy = -(probs * (probs + 1e-10).log()).sum(dim=-1)  # [B, K]
    return (-posterior_alpha * entropy).exp().clamp_max(posterior_threshold)


@functools.lru_cache(maxsize=256)
def synthetic_conditional_rate(acceptance_rate: float, num_drafts: int) -> float:
    """The constant per-position conditional acceptance probability a for which a draft of ``num_drafts`` tokens
    accepts ``acceptance_rate`` of them on average: (a + a^2 + ... + a^K) / K = r, solved by bisection.

    Acceptance stops at the first rejection, so position i is reached and accepted with probability a^i (the
    position-decaying schedule vLLM calibrates to synthetic_acceptance_rate). r itself per position would give
    (r + ... + r^K) / K instead: 0.39 for K = 3, r = 0.6.
    """
    if not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"synthetic_acceptance_rate must be in [0, 1], but got {acceptance_rate}")
    if num_drafts <= 1 or acceptance_rate in (0.0, 1.0):
        return acceptance_rate
    lo, hi = 0.0, 1.0
    # the mean is increasing in a; 60 halvings reach float precision
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, num_drafts + 1)) / num_drafts < acceptance_rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def synthetic_verify(
    draft_token_ids: torch.Tensor,  # [B, K] int64, -1 padded
    target_probs: torch.Tensor,  # [B, K+1, V]
    uniform_samples: torch.Tensor,  # [B, K] U[0, 1)
    exp_noise: torch.Tensor,  # [B, K+1, V] Exp(1)
    acceptance_rate: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts with a position-decaying probability so that a row accepts ``acceptance_rate`` of its drafts
    on average; stop at the first rejection.

    Each row is calibrated for its own draft count g (``synthetic_conditional_rate(r, g)``), so the mean of
    accepted / drafted is r for proposers whose drafts vary in length too. NOT lossless: the output distribution
    is not the target's. For benchmarking the engine at a controlled acceptance rate only. Recovered/bonus tokens
    are samples of p.
    """
    K = draft_token_ids.shape[1]
    table = [0.0] + [synthetic_conditional_rate(acceptance_rate, g) for g in range(1, K + 1)]
    rates = torch.tensor(table, dtype=uniform_samples.dtype, device=uniform_samples.device)  # [K+1]
    num_draft = (draft_token_ids >= 0).sum(dim=1)  # [B]
    accept = uniform_samples < rates[num_draft][:, None]  # [B, K]
    return _assemble(draft_token_ids, accept, exponential_race(target_probs, exp_noise))


# ---------------------------------------------------------------------------- dispatcher

# method -> its rule for random rows, over (drafts, p, q, uniform, noise) plus the method's own options
_RANDOM_RULES = {
    "strict": lambda d, p, q, u, e, **_: strict_verify(d, p, e),
    "probabilistic": lambda d, p, q, u, e, block, thresholds, **_: (
        block_verify if block else probabilistic_verify
    )(d, p, q, u, e, thresholds),
    "synthetic": lambda d, p, q, u, e, rate, **_: synthetic_verify(d, p, u, e, rate),
}


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
    block: bool = False,  # probabilistic only: Block Verify
    thresholds: torch.Tensor | None = None,  # [B, K] probabilistic only: Entropy Verify (entropy_thresholds)
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
    if (block or thresholds is not None) and method != "probabilistic":
        raise ValueError(f"Block / Entropy Verify need method 'probabilistic', got {method!r}")

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
    if method != "strict" and uniform_samples is None:
        raise ValueError(f"method {method!r} needs uniform_samples")
    if method == "synthetic" and synthetic_acceptance_rate is None:
        raise ValueError("method 'synthetic' needs synthetic_acceptance_rate")
    rand = _RANDOM_RULES[method](
        draft_token_ids,
        target_probs,
        draft_probs,
        uniform_samples,
        exp_noise,
        block=block,
        thresholds=thresholds,
        rate=synthetic_acceptance_rate,
    )
    if greedy is None:
        return rand
    out = torch.where(is_greedy[:, None], greedy[0], rand[0])  # [B, K+1]
    num_accepted = torch.where(is_greedy, greedy[1], rand[1])  # [B]
    return out, num_accepted
