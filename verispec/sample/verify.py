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
- ``sample_u`` ``[B, K+1]`` in [0, 1): one per position for its categorical sample, drawn by inverse CDF
  (``categorical``: the first token whose cumulative mass exceeds u times the total), an exact sample of
  ``p / p.sum()`` (p need not be normalised). One uniform per position, not a vocabulary's worth of noise.

``draw_uniform`` builds both, drawing each row that has a ``torch.Generator`` from that generator (one loop step
per seeded request, not per token).

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


def categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per distribution by inverse CDF: the first index whose cumulative mass (float64) exceeds u times
    the total. probs [..., V] >= 0, need not be normalised; u [...] in [0, 1) -> [...] int64. u < 1 keeps the
    point below the total, so a token of zero mass is never drawn."""
    # [..., V]
    cdf = probs.double().cumsum(dim=-1)
    # [..., 1]
    point = (u.double() * cdf[..., -1])[..., None]
    return torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


# ---------------------------------------------------------------------------- helpers


def _assemble(
    # [B, K] int64, -1 padded
    draft_token_ids: torch.Tensor,
    # [B, K] bool, per-position acceptance (ignored where padded)
    accept: torch.Tensor,
    # [B, K+1] token to emit if the first rejection is at j
    next_tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted prefix (up to the first rejection) + one token from ``next_tokens`` at ``num_accepted``."""
    # [B, K]
    valid = draft_token_ids >= 0
    # [B]
    num_accepted = (accept & valid).long().cumprod(dim=1).sum(dim=1)
    return assemble_at(draft_token_ids, num_accepted, next_tokens)


def assemble_at(
    # [B, K] int64, -1 padded
    draft_token_ids: torch.Tensor,
    # [B] accepted prefix length
    num_accepted: torch.Tensor,
    # [B, K+1] (or broadcastable) token to emit at position num_accepted
    next_tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts [0, num_accepted), then ``next_tokens[num_accepted]``, then -1 padding. -> ([B, K+1], [B])."""
    B, K = draft_token_ids.shape
    if K == 0:
        # nothing drafted: the next token alone
        return next_tokens.to(draft_token_ids.dtype).expand(B, 1), num_accepted
    # [K+1]
    pos = torch.arange(K + 1, device=draft_token_ids.device)
    pad = torch.full((B, 1), -1, dtype=draft_token_ids.dtype, device=draft_token_ids.device)
    # [B, K+1]
    drafts = torch.cat([draft_token_ids, pad], dim=1)
    # [B, 1]
    na = num_accepted[:, None]
    out = torch.where(pos < na, drafts, torch.where(pos == na, next_tokens.to(drafts.dtype), -1))
    return out, num_accepted


def _draft_index(draft_token_ids: torch.Tensor) -> torch.Tensor:
    # [B, K, 1], padding -> token 0 (masked later)
    return draft_token_ids.clamp_min(0)[..., None]


# ---------------------------------------------------------------------------- methods


def greedy_verify(
    # [B, K] int64, -1 padded
    draft_token_ids: torch.Tensor,
    # [B, K+1] int64
    target_argmax: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while draft == target argmax; then emit the target argmax."""
    K = draft_token_ids.shape[1]
    # [B, K]
    accept = draft_token_ids == target_argmax[:, :K]
    return _assemble(draft_token_ids, accept, target_argmax)


def strict_verify(
    # [B, K] int64, -1 padded
    draft_token_ids: torch.Tensor,
    # [B, K+1, V]
    target_probs: torch.Tensor,
    # [B, K+1] U[0, 1)
    sample_u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample the target at every position; accept while the sample equals the draft.

    Exactly lossless: every emitted token (accepted draft, replacement, bonus) is the
    target's own sample at its position. Ignores draft probabilities.
    """
    K = draft_token_ids.shape[1]
    # [B, K+1]
    samples = categorical(target_probs, sample_u)
    # [B, K]
    accept = draft_token_ids == samples[:, :K]
    return _assemble(draft_token_ids, accept, samples)


def probabilistic_verify(
    # [B, K] int64, -1 padded
    draft_token_ids: torch.Tensor,
    # [B, K+1, V]
    target_probs: torch.Tensor,
    # [B, K, V], None = one-hot q at the draft
    draft_probs: torch.Tensor | None,
    # [B, K] U[0, 1)
    uniform_samples: torch.Tensor,
    # [B, K+1] U[0, 1)
    sample_u: torch.Tensor,
    # [B, K] Entropy Verify; None = 1 (lossless)
    thresholds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. / Chen et al. speculative sampling (lossless).

    Accept x_j with prob min(1, p(x_j) / q(x_j)) (with ``thresholds``: min(1, p / (q t))); at the first
    rejection emit a sample of normalize(max(p - q, 0)) (p if that is all zero); after the last draft emit a
    bonus sample of p at position num_draft.
    """
    B, K = draft_token_ids.shape
    # [B, K, 1]
    idx = _draft_index(draft_token_ids)
    # [B, K]
    valid = draft_token_ids >= 0
    # [B, K, 1]
    p_draft = target_probs[:, :K].gather(-1, idx)
    # [B, K, 1]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(-1, idx)
    # [B, K]
    u = uniform_samples if thresholds is None else uniform_samples * thresholds
    # [B, K]
    accept = (u[..., None] * q_draft < p_draft).squeeze(-1)
    # [B]
    num_accepted = (accept & valid).long().cumprod(dim=1).sum(dim=1)
    # Only the row at num_accepted is sampled, so only it gets a residual: [B, V]
    rows = torch.arange(B, device=draft_token_ids.device)
    p_row = target_probs[rows, num_accepted]
    # [B] whether that row rejected a real draft (else it is the bonus row or a padded one: p itself)
    at = num_accepted.clamp(0, max(K - 1, 0))
    rejected = (num_accepted < K) & valid[rows, at] if K > 0 else torch.zeros_like(valid[:, 0])
    if draft_probs is None:
        # q one-hot: the residual is p with the rejected draft's token zeroed
        # [B, 1]
        tok = idx[rows, at]
        residual = p_row.scatter(-1, tok, torch.where(rejected[:, None], 0.0, p_row.gather(-1, tok)))
    else:
        residual = (p_row - draft_probs[rows, at] * rejected[:, None]).clamp_min(0.0)
    # [B, 1]
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    # [B, V] unnormalised is fine
    residual = torch.where(empty, p_row, residual)
    # [B]
    next_tokens = categorical(residual, sample_u[rows, num_accepted])
    return assemble_at(draft_token_ids, num_accepted, next_tokens[:, None])


def block_verify(
    # [B, K] int64, -1 padded
    draft_token_ids: torch.Tensor,
    # [B, K+1, V]
    target_probs: torch.Tensor,
    # [B, K, V], None = one-hot q at the draft
    draft_probs: torch.Tensor | None,
    # [B, K] U[0, 1)
    uniform_samples: torch.Tensor,
    # [B, K+1] U[0, 1)
    sample_u: torch.Tensor,
    # [B, K] Entropy Verify; None = 1 (lossless)
    thresholds: torch.Tensor | None = None,
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
    # [B, K, 1]
    idx = _draft_index(draft_token_ids)
    # [B, K]; a row's drafts are a prefix
    valid = draft_token_ids >= 0
    # [B, K]
    p_x = target_probs[:, :K].gather(-1, idx).squeeze(-1)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, idx).squeeze(-1)
    tiny = torch.finfo(p_x.dtype).tiny
    # [B, K]
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(tiny), (p_x > 0).to(p_x.dtype))
    ratio = torch.where(valid, ratio, 1.0)
    # w_i = min(1, w_{i-1} r_i) is a random walk in log space reflected at 0: log w_i = S_i - max(0, max_j<=i S_j)
    # [B, K]
    s = ratio.log().cumsum(dim=1)
    # [B, K] w_1..w_K
    w = (s - s.cummax(dim=1).values.clamp_min(0.0)).exp()
    # [B, K+1] w_0..w_K
    w0 = torch.cat([torch.ones(B, 1, dtype=w.dtype, device=dev), w], dim=1)
    # [B, K+1, V]: row i is max(w_i p_i - q_i, 0) once q is taken off
    residual = w0[..., None] * target_probs
    if draft_probs is None:
        # [B, K, 1] one-hot q at the draft
        sub = torch.where(valid, 1.0, 0.0).to(residual.dtype)[..., None]
        residual[:, :K].scatter_add_(-1, idx, -sub)
    else:
        residual[:, :K] -= draft_probs * valid[..., None]
    residual.clamp_min_(0.0)
    # [B, K+1]; z[:, i] = Z_i
    z = residual.sum(dim=-1)
    # [B, K], i = 1..K
    zi = z[:, 1:]
    denom = zi + 1.0 - w
    # [B, K]
    h = torch.where(denom > 0, zi / denom.clamp_min(tiny), 1.0)
    # [K]
    pos = torch.arange(1, K + 1, device=dev)
    # [B, 1] draft count g
    last = valid.sum(dim=1, keepdim=True)
    h = torch.where(pos == last, w, h)
    u = uniform_samples if thresholds is None else uniform_samples * thresholds
    # [B, K]
    passed = valid & (u <= h)
    # [B]
    tau = (passed * pos).amax(dim=1)
    rows = torch.arange(B, device=dev)
    # [B, V]
    res_tau = residual[rows, tau]
    # [B, 1]
    empty = res_tau.sum(dim=-1, keepdim=True) <= 0
    res_tau = torch.where(empty, target_probs[rows, tau], res_tau)
    # [B]
    final = categorical(res_tau, sample_u[rows, tau])
    return assemble_at(draft_token_ids, tau, final[:, None])


def entropy_thresholds(
    # [B, K, V] target distributions the drafts are verified against (before sampling transforms)
    probs: torch.Tensor,
    posterior_threshold: float,
    posterior_alpha: float,
) -> torch.Tensor:
    """Entropy Verify's per-position threshold min(exp(-alpha * H(p)), posterior_threshold), H in nats
    (vLLM Ascend's rejection_sampler_config). -> [B, K]."""
    # [B, K]
    entropy = -(probs * (probs + 1e-10).log()).sum(dim=-1)
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
    # [B, K] int64, -1 padded
    draft_token_ids: torch.Tensor,
    # [B, K+1, V]
    target_probs: torch.Tensor,
    # [B, K] U[0, 1)
    uniform_samples: torch.Tensor,
    # [B, K+1] U[0, 1)
    sample_u: torch.Tensor,
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
    # [K+1]
    rates = torch.tensor(table, dtype=uniform_samples.dtype, device=uniform_samples.device)
    # [B]
    num_draft = (draft_token_ids >= 0).sum(dim=1)
    # [B, K]
    accept = uniform_samples < rates[num_draft][:, None]
    return _assemble(draft_token_ids, accept, categorical(target_probs, sample_u))


# ---------------------------------------------------------------------------- dispatcher

# method -> its rule for random rows, over (drafts, p, q, uniform, sample_u) plus the method's own options
_RANDOM_RULES = {
    "strict": lambda d, p, q, u, e, **_: strict_verify(d, p, e),
    "probabilistic": lambda d, p, q, u, e, block, thresholds, **_: (
        block_verify if block else probabilistic_verify
    )(d, p, q, u, e, thresholds),
    "synthetic": lambda d, p, q, u, e, rate, **_: synthetic_verify(d, p, u, e, rate),
}


def rejection_sample(
    method: str,
    # [B, K] int64, -1 padded
    draft_token_ids: torch.Tensor,
    # [B, K+1, V], may be None if every row is greedy
    target_probs: torch.Tensor | None,
    # [B] bool; None = every row random
    is_greedy: torch.Tensor | None = None,
    *,
    # [B, K+1]; default target_probs.argmax(-1)
    target_argmax: torch.Tensor | None = None,
    # [B, K, V]; None = draft-free (one-hot q)
    draft_probs: torch.Tensor | None = None,
    # [B, K]; probabilistic / synthetic
    uniform_samples: torch.Tensor | None = None,
    # [B, K+1]; None = every row greedy
    sample_u: torch.Tensor | None = None,
    synthetic_acceptance_rate: float | None = None,
    # probabilistic only: Block Verify
    block: bool = False,
    # [B, K] probabilistic only: Entropy Verify (entropy_thresholds)
    thresholds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch mixing greedy and random rows. Returns ``(output_token_ids [B, K+1],
    num_accepted [B])``.

    Greedy rows (``is_greedy``) always use the greedy rule, whatever ``method`` is; random
    rows use ``method`` (``strict`` | ``probabilistic`` | ``synthetic``). Which paths run is
    decided from which inputs are None, never from tensor values (no host sync):
    ``sample_u=None`` means no random rows, ``is_greedy=None`` means no greedy rows. When
    both run, the result is selected per row, so random inputs of greedy rows are ignored.
    """
    if method not in METHODS:
        raise ValueError(f"unknown rejection sampling method {method!r}; expected one of {METHODS}")
    if sample_u is None and is_greedy is None:
        raise ValueError("sample_u is required unless every row is greedy (pass is_greedy)")
    if (block or thresholds is not None) and method != "probabilistic":
        raise ValueError(f"Block / Entropy Verify need method 'probabilistic', got {method!r}")

    greedy = None
    if is_greedy is not None:
        if target_argmax is None:
            if target_probs is None:
                raise ValueError("greedy rows need target_argmax or target_probs")
            # [B, K+1]
            target_argmax = target_probs.argmax(dim=-1)
        greedy = greedy_verify(draft_token_ids, target_argmax)
        if sample_u is None:
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
        sample_u,
        block=block,
        thresholds=thresholds,
        rate=synthetic_acceptance_rate,
    )
    if greedy is None:
        return rand
    # [B, K+1]
    out = torch.where(is_greedy[:, None], greedy[0], rand[0])
    # [B]
    num_accepted = torch.where(is_greedy, greedy[1], rand[1])
    return out, num_accepted
