import pytest
import torch

from verispec.sample.verify import (
    METHODS,
    categorical,
    draw_uniform,
    entropy_thresholds,
    greedy_verify,
    rejection_sample,
    synthetic_conditional_rate,
)

V = 8
P = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02], dtype=torch.float64)
# deliberately poor draft: mass on the target's unlikely tokens
Q_POOR = P.flip(0)
# one-step verifications per statistical test, batched as rows
N = 20_000
MIN_PVALUE = 1e-4


def _t(rows):
    return torch.tensor(rows, dtype=torch.long)


def _chi2_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of ``tokens`` to ``p`` (support of p only)."""
    support = p > 0
    assert not torch.isin(tokens, torch.nonzero(~support).flatten()).any(), "zero-prob token emitted"
    counts = torch.bincount(tokens, minlength=p.numel()).double()[support]
    expected = tokens.numel() * p[support] / p[support].sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(support.sum().item() - 1, dtype=torch.float64)
    # P(Chi2(df) >= stat)
    return torch.special.gammaincc(df / 2, stat / 2).item()


def _one_hot_probs(argmax: torch.Tensor, vocab: int = V) -> torch.Tensor:
    # [B, K+1, V]
    return torch.nn.functional.one_hot(argmax.clamp_min(0), vocab).double()


def _simulate(method, p_rows, q_rows, seed=0, draft_probs_mode="q", rate=None, n=N):
    """Draft x_j ~ q_j for j < K, verify against p_j (j <= K). p_rows [K+1, V], q_rows [K, V]."""
    g = torch.Generator().manual_seed(seed)
    K, N = q_rows.shape[0], n
    drafts = torch.stack(
        [torch.multinomial(q_rows[j], N, replacement=True, generator=g) for j in range(K)], 1
    )
    # [N, K+1, V]
    target_probs = p_rows.expand(N, K + 1, V)
    draft_probs = {"q": q_rows.expand(N, K, V), "none": None, "uniform": torch.full((N, K, V), 1.0 / V)}[
        draft_probs_mode
    ]
    return rejection_sample(
        method,
        drafts,
        target_probs,
        draft_probs=draft_probs,
        uniform_samples=torch.rand(N, K, generator=g, dtype=torch.float64),
        sample_u=torch.rand(N, K + 1, generator=g, dtype=torch.float64),
        synthetic_acceptance_rate=rate,
    )


# ---------------------------------------------------------------------------- greedy tables


def test_greedy_first_mismatch_replaced_by_target():
    out, na = greedy_verify(_t([[1, 2, 3]]), _t([[1, 5, 3, 4]]))
    assert out.tolist() == [[1, 5, -1, -1]] and na.tolist() == [1]


def test_greedy_all_accepted_adds_bonus():
    out, na = greedy_verify(_t([[1, 2, 3]]), _t([[1, 2, 3, 4]]))
    assert out.tolist() == [[1, 2, 3, 4]] and na.tolist() == [3]


def test_greedy_no_drafts_emits_one_token():
    out, na = greedy_verify(_t([[-1, -1, -1]]), _t([[7, 1, 2, 3]]))
    assert out.tolist() == [[7, -1, -1, -1]] and na.tolist() == [0]
    # K = 0
    out, na = greedy_verify(torch.empty(2, 0, dtype=torch.long), _t([[7], [9]]))
    assert out.tolist() == [[7], [9]] and na.tolist() == [0, 0]


def test_greedy_mixed_num_draft():
    drafts = _t([[1, 2, 3], [4, -1, -1], [-1, -1, -1], [5, 6, -1], [1, 2, 3]])
    argmax = _t([[1, 2, 3, 9], [4, 8, 0, 0], [6, 0, 0, 0], [5, 7, 0, 0], [2, 2, 3, 9]])
    out, na = greedy_verify(drafts, argmax)
    assert out.tolist() == [[1, 2, 3, 9], [4, 8, -1, -1], [6, -1, -1, -1], [5, 7, -1, -1], [2, -1, -1, -1]]
    assert na.tolist() == [3, 1, 0, 1, 0]


# ---------------------------------------------------------------------------- dispatcher


@pytest.mark.parametrize("method", METHODS)
def test_mixed_greedy_and_random_rows(method):
    # random rows have one-hot targets, so every method (synthetic at rate 1) is deterministic
    drafts = _t([[1, 2, 3], [1, 2, 3], [4, -1, -1], [-1, -1, -1], [5, 6, -1]])
    argmax = _t([[1, 5, 3, 4], [1, 2, 3, 4], [4, 7, 0, 0], [6, 0, 0, 0], [5, 6, 2, 0]])
    is_greedy = torch.tensor([True, False, True, False, False])
    B, K = drafts.shape
    out, na = rejection_sample(
        method,
        drafts,
        _one_hot_probs(argmax),
        is_greedy,
        uniform_samples=torch.full((B, K), 0.5, dtype=torch.float64),
        sample_u=torch.zeros(B, K + 1, dtype=torch.float64),
        synthetic_acceptance_rate=1.0,
    )
    # row 0 is greedy: rejected at 2 even for synthetic(rate=1) which would accept everything
    assert out.tolist() == [[1, 5, -1, -1], [1, 2, 3, 4], [4, 7, -1, -1], [6, -1, -1, -1], [5, 6, 2, -1]]
    assert na.tolist() == [1, 3, 1, 0, 2]


def test_all_greedy_without_random_inputs():
    out, na = rejection_sample(
        "strict", _t([[1, 2, 3]]), None, torch.tensor([True]), target_argmax=_t([[1, 2, 0, 4]])
    )
    assert out.tolist() == [[1, 2, 0, -1]] and na.tolist() == [2]


def test_probabilistic_empty_residual_falls_back_to_p():
    # inconsistent q (one-hot at the target's token, draft elsewhere): max(p - q, 0) == 0
    # [1, 2, V]
    target = _one_hot_probs(_t([[3, 3]]))
    out, na = rejection_sample(
        "probabilistic",
        _t([[5]]),
        target,
        draft_probs=_one_hot_probs(_t([[3]])),
        uniform_samples=torch.zeros(1, 1, dtype=torch.float64),
        sample_u=torch.zeros(1, 2, dtype=torch.float64),
    )
    assert out.tolist() == [[3, -1]] and na.tolist() == [0]


def test_bad_arguments():
    d, p = _t([[1]]), torch.full((1, 2, V), 1.0 / V)
    with pytest.raises(ValueError):
        rejection_sample("nope", d, p, sample_u=torch.zeros(1, 2))
    with pytest.raises(ValueError):
        # no random inputs and no greedy rows
        rejection_sample("strict", d, p)
    with pytest.raises(ValueError):
        # no uniforms
        rejection_sample("probabilistic", d, p, sample_u=torch.zeros(1, 2))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("with_q", [False, True])
def test_no_host_sync(method, with_q):
    # meta tensors have no data: any .item()/.tolist()/bool(tensor) inside would raise
    B, K = 4, 3
    meta = {"device": "meta"}
    out, na = rejection_sample(
        method,
        torch.empty(B, K, dtype=torch.long, **meta),
        torch.empty(B, K + 1, V, **meta),
        torch.empty(B, dtype=torch.bool, **meta),
        draft_probs=torch.empty(B, K, V, **meta) if with_q else None,
        uniform_samples=torch.empty(B, K, **meta),
        sample_u=torch.empty(B, K + 1, **meta),
        synthetic_acceptance_rate=0.5,
    )
    assert out.shape == (B, K + 1) and out.dtype == torch.long and na.shape == (B,)


# ---------------------------------------------------------------------------- randomness


def test_per_request_generators_are_honoured():
    def gens(seeds):
        return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]

    a = draw_uniform((3, 4), gens([7, None, 11]))
    # same requests, other batch and order
    b = draw_uniform((2, 4), gens([11, 7]))
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    u1 = draw_uniform((2, 3), gens([5, None]))
    u2 = draw_uniform((1, 3), gens([5]))
    assert torch.equal(u1[0], u2[0]) and ((u1 >= 0) & (u1 < 1)).all()


def test_categorical_is_the_inverse_cdf_and_never_draws_a_zero_mass_token():
    # unnormalised, with zero-mass tokens first, between and last
    p = torch.tensor([0.0, 2.0, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float32)
    u = torch.tensor([0.0, 0.49, 0.5, 0.74, 0.75, 0.999, 1 - 2**-24])
    assert categorical(p.expand(7, -1), u).tolist() == [1, 1, 4, 4, 5, 5, 5]
    # shapes: [..., V] with [...] uniforms
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 4, V, generator=g).softmax(-1)
    assert categorical(probs, torch.rand(3, 4, generator=g)).shape == (3, 4)


def test_categorical_follows_the_distribution():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.5, 0.0, 0.2, 0.3], dtype=torch.float64)
    n = 20000
    draws = categorical(p.expand(n, -1), torch.rand(n, generator=g, dtype=torch.float64))
    freq = torch.bincount(draws, minlength=4).double() / n
    # 4 standard errors at most
    assert (freq - p).abs().max() < 4 * (0.25 / n) ** 0.5 and freq[1] == 0


# ---------------------------------------------------------------------------- statistics


@pytest.mark.parametrize(
    "method,q_mode",
    [("strict", "none"), ("probabilistic", "q"), ("probabilistic", "none")],
)
def test_first_token_is_distributed_as_target(method, q_mode):
    out, na = _simulate(method, P.expand(2, V), Q_POOR[None], draft_probs_mode=q_mode)
    assert _chi2_pvalue(out[:, 0], P) > MIN_PVALUE
    # acceptance rate: strict accepts iff the target sample equals the draft
    # strict: accept iff the target sample equals the draft; draft-free: accept w.p. p(x), x ~ q
    rate = torch.minimum(P, Q_POOR).sum() if q_mode == "q" else (P * Q_POOR).sum()
    std = (rate * (1 - rate) / N).sqrt()
    assert abs(na.double().mean() - rate) < 5 * std


def test_probabilistic_residual_never_emits_zero_prob_tokens():
    p = torch.tensor([0.4, 0.3, 0.3, 0, 0, 0, 0, 0], dtype=torch.float64)
    out, _ = _simulate("probabilistic", p.expand(2, V), torch.full((1, V), 1.0 / V, dtype=torch.float64))
    # also asserts tokens 3..7 never appear
    assert _chi2_pvalue(out[:, 0], p) > MIN_PVALUE


@pytest.mark.parametrize(
    "method,q_mode,rate",
    [
        # always emit the draft: distribution q
        ("synthetic", "q", 1.0),
        # half draft, half target: mixture
        ("synthetic", "q", 0.5),
        # acceptance and residual use the wrong q
        ("probabilistic", "uniform", None),
    ],
)
def test_wrong_samplers_fail_the_same_test(method, q_mode, rate):
    out, _ = _simulate(method, P.expand(2, V), Q_POOR[None], draft_probs_mode=q_mode, rate=rate)
    assert _chi2_pvalue(out[:, 0], P) < MIN_PVALUE


@pytest.mark.parametrize(
    "method,q_mode", [("strict", "none"), ("probabilistic", "q"), ("probabilistic", "none")]
)
def test_later_tokens_given_acceptance_follow_target(method, q_mode):
    # [K+1 = 3, V], a different p per position
    p_rows = torch.stack([P, P.roll(3), P.flip(0)])
    # [K = 2, V], mediocre drafts
    q_rows = (p_rows[:2] + torch.stack([Q_POOR, P.roll(5)])) / 2
    out, na = _simulate(method, p_rows, q_rows, seed=1, draft_probs_mode=q_mode, n=60_000)
    assert _chi2_pvalue(out[:, 0], p_rows[0]) > MIN_PVALUE
    assert _chi2_pvalue(out[na >= 1, 1], p_rows[1]) > MIN_PVALUE
    assert _chi2_pvalue(out[na == 2, 2], p_rows[2]) > MIN_PVALUE
    assert ((out >= 0).sum(1) == na + 1).all()


def test_wrong_sampler_fails_later_token_test():
    p_rows = torch.stack([P, P.roll(3), P.flip(0)])
    q_rows = torch.stack([Q_POOR, P.roll(5)])
    out, na = _simulate("synthetic", p_rows, q_rows, seed=1, rate=0.9)
    assert _chi2_pvalue(out[na >= 1, 1], p_rows[1]) < MIN_PVALUE


# ---------------------------------------------------------------------------- synthetic acceptance


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("r", [0.0, 0.1, 0.39, 0.6, 0.9, 1.0])
def test_synthetic_conditional_rate_solves_the_mean(k, r):
    a = synthetic_conditional_rate(r, k)
    # decaying marginals need a conditional rate at least r
    assert 0.0 <= a <= 1.0 and a >= r - 1e-12
    assert sum(a**i for i in range(1, k + 1)) / k == pytest.approx(r, abs=1e-12)


def test_synthetic_conditional_rate_known_values():
    assert synthetic_conditional_rate(0.6, 1) == 0.6
    # K = 2: (a + a^2) / 2 = 0.6 -> a = (-1 + sqrt(1 + 4.8)) / 2
    assert synthetic_conditional_rate(0.6, 2) == pytest.approx((-1 + 5.8**0.5) / 2, abs=1e-12)
    with pytest.raises(ValueError, match="synthetic_acceptance_rate must be in"):
        synthetic_conditional_rate(1.5, 3)


@pytest.mark.parametrize("k,r", [(3, 0.6), (5, 0.3), (4, 0.85)])
def test_synthetic_mean_acceptance_is_the_rate(k, r):
    # all rows draft k tokens: accepted / drafted averages r, and position i is accepted with probability a^i
    n = 40_000
    g = torch.Generator().manual_seed(k)
    drafts = torch.randint(0, V, (n, k), generator=g)
    _, na = rejection_sample(
        "synthetic",
        drafts,
        P.expand(n, k + 1, V),
        uniform_samples=torch.rand(n, k, generator=g, dtype=torch.float64),
        sample_u=torch.rand(n, k + 1, generator=g, dtype=torch.float64),
        synthetic_acceptance_rate=r,
    )
    # [n]
    frac = na.double() / k
    assert abs(frac.mean().item() - r) < 5 * (frac.std() / n**0.5).item()
    a = synthetic_conditional_rate(r, k)
    for i in range(1, k + 1):
        marginal = a**i
        std = (marginal * (1 - marginal) / n) ** 0.5
        assert abs((na >= i).double().mean().item() - marginal) < 5 * std + 1e-9


def test_synthetic_calibrates_each_row_for_its_draft_count():
    # rows drafting 1, 2 or 4 tokens each accept r of their drafts on average (n-gram / suffix drafts vary)
    n, K, r = 30_000, 4, 0.6
    g = torch.Generator().manual_seed(5)
    # [n]
    counts = torch.tensor([1, 2, 4]).repeat(n // 3)
    # [n, K]
    drafts = torch.where(torch.arange(K)[None] < counts[:, None], 1, -1)
    _, na = rejection_sample(
        "synthetic",
        drafts,
        P.expand(n, K + 1, V),
        uniform_samples=torch.rand(n, K, generator=g, dtype=torch.float64),
        sample_u=torch.rand(n, K + 1, generator=g, dtype=torch.float64),
        synthetic_acceptance_rate=r,
    )
    assert (na <= counts).all()
    for c in (1, 2, 4):
        frac = na[counts == c].double() / c
        assert abs(frac.mean().item() - r) < 5 * (frac.std() / frac.numel() ** 0.5).item()


# ---------------------------------------------------------------------------- Block / Entropy Verify


def test_block_verify_accepts_past_a_failed_position():
    # drafts 1, 2, 3 from a draft-free proposer (one-hot q); the target gives them 0.5, 1, 1: the block as a whole
    # has probability 0.5, so it is accepted iff u_3 <= w_3 = 0.5 whatever u_1 says (h_1 = h_2 = 0 here)
    d = _t([[1, 2, 3]])
    p = torch.tensor(
        [[[0.5, 0.5, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [0.25, 0.25, 0.25, 0.25]]], dtype=torch.float64
    )
    noise = torch.zeros(1, 4, dtype=torch.float64)
    out, na = rejection_sample(
        "probabilistic", d, p, uniform_samples=torch.tensor([[0.9, 0.9, 0.3]]), sample_u=noise, block=True
    )
    # bonus: u = 0 draws the first token with mass, token 0
    assert out.tolist() == [[1, 2, 3, 0]] and na.tolist() == [3]
    # token-level verification rejects x_1 (0.9 > 0.5)
    out, na = rejection_sample(
        "probabilistic", d, p, uniform_samples=torch.tensor([[0.9, 0.9, 0.3]]), sample_u=noise
    )
    # residual max(p - q, 0) = token 0
    assert na.tolist() == [0] and out.tolist() == [[0, -1, -1, -1]]
    # nothing passes: the residual of position 0 (token 0)
    out, na = rejection_sample(
        "probabilistic", d, p, uniform_samples=torch.tensor([[0.3, 0.9, 0.9]]), sample_u=noise, block=True
    )
    assert out.tolist() == [[0, -1, -1, -1]] and na.tolist() == [0]


def test_block_verify_with_one_draft_is_token_verification():
    g = torch.Generator().manual_seed(3)
    B = 500
    p = torch.rand(B, 2, V, generator=g, dtype=torch.float64).softmax(-1)
    q = torch.rand(B, 1, V, generator=g, dtype=torch.float64).softmax(-1)
    d = torch.multinomial(q[:, 0], 1, generator=g)
    u = torch.rand(B, 1, generator=g, dtype=torch.float64)
    noise = torch.rand(B, 2, generator=g, dtype=torch.float64)
    for dp in (q, None):
        block = rejection_sample(
            "probabilistic", d, p, draft_probs=dp, uniform_samples=u, sample_u=noise, block=True
        )
        token = rejection_sample("probabilistic", d, p, draft_probs=dp, uniform_samples=u, sample_u=noise)
        assert torch.equal(block[0], token[0]) and torch.equal(block[1], token[1])


def test_block_verify_ragged_rows_stop_at_their_own_last_draft():
    # row 0 has one draft, row 1 none: with u = 0 every test passes, so each row accepts all of its drafts
    d = _t([[2, -1, -1], [-1, -1, -1]])
    p = torch.full((2, 4, V), 1.0 / V, dtype=torch.float64)
    out, na = rejection_sample(
        "probabilistic", d, p, uniform_samples=torch.zeros(2, 3), sample_u=torch.zeros(2, 4), block=True
    )
    assert (
        na.tolist() == [1, 0]
        and out[0, 0] == 2
        and (out[:, 2:] == -1).all()
        and (out[:, 0:2] >= 0).sum() == 3
    )


def _markov_outputs(method, q_mode, block=False, entropy=None, n=20_000, length=6, k=3, seed=0):
    """Generate `length` tokens per sequence by repeated verification steps, drafts from a poor Markov draft, the
    target a Markov chain (the next-token law depends on the previous token): the emitted sequences must follow
    the target chain exactly, whatever the drafts and acceptance were."""
    g = torch.Generator().manual_seed(seed)
    # every sequence starts after token 0
    last = torch.zeros(n, dtype=torch.long)
    out = torch.full((n, length), -1, dtype=torch.long)
    count = torch.zeros(n, dtype=torch.long)
    # over the steps of sequences still short of `length`
    steps = accepted = 0
    while (count < length).any():
        drafts, ctx = [], last
        for _ in range(k):
            ctx = torch.multinomial(MQ[ctx], 1, generator=g).squeeze(1)
            drafts.append(ctx)
        # [n, k]
        d = torch.stack(drafts, 1)
        # [n, k+1]
        contexts = torch.cat([last[:, None], d], 1)
        # [n, k+1, V]
        target = MP[contexts]
        thresholds = None if entropy is None else entropy_thresholds(target[:, :k], *entropy)
        res, na = rejection_sample(
            method,
            d,
            target,
            draft_probs=MQ[contexts[:, :k]] if q_mode == "q" else None,
            uniform_samples=torch.rand(n, k, generator=g, dtype=torch.float64),
            sample_u=torch.rand(n, k + 1, generator=g, dtype=torch.float64),
            block=block,
            thresholds=thresholds,
        )
        # [n, k+1] output index of each emitted token
        at = count[:, None] + torch.arange(k + 1)
        keep = (res >= 0) & (at < length)
        out[keep.nonzero(as_tuple=True)[0], at[keep]] = res[keep]
        last = res.gather(1, na[:, None]).squeeze(1)
        short = count < length
        steps, accepted = steps + int(short.sum()), accepted + int(na[short].sum())
        count += na + 1
    return out, accepted / steps


def _markov_law_pvalues(out: torch.Tensor) -> list[float]:
    """Chi-square p-values of every output position's marginal and of (y_0, y_1)'s joint law against the chain."""
    # law of y_0 (after token 0)
    laws = [torch.nn.functional.one_hot(torch.tensor(0), V).double() @ MP]
    for _ in range(1, out.shape[1]):
        laws.append(laws[-1] @ MP)
    pvalues = [_chi2_pvalue(out[:, t], law) for t, law in enumerate(laws)]
    # law of (y_0, y_1)
    joint = (laws[0][:, None] * MP).flatten()
    return pvalues + [_chi2_pvalue(out[:, 0] * V + out[:, 1], joint)]


# [V, V] target
MP = torch.stack([P.roll(i) for i in range(V)]) * 0.7 + 0.3 * torch.eye(
    V,
    dtype=torch.float64,
)
# a poor draft chain
MQ = (MP.roll(1, dims=1) + 0.2).softmax(-1)


@pytest.mark.parametrize(
    "method,q_mode,block",
    [
        ("strict", "none", False),
        ("probabilistic", "q", False),
        ("probabilistic", "none", False),
        ("probabilistic", "q", True),
        ("probabilistic", "none", True),
    ],
)
def test_generated_sequences_follow_the_target_chain(method, q_mode, block):
    assert min(_markov_law_pvalues(_markov_outputs(method, q_mode, block)[0])) > MIN_PVALUE


@pytest.mark.parametrize("q_mode,block", [("q", False), ("none", True)])
def test_entropy_verify_is_not_lossless_and_the_test_sees_it(q_mode, block):
    # posterior_alpha 1: thresholds ~exp(-1.7) here, drafts accepted far more often than the target allows
    assert (
        min(_markov_law_pvalues(_markov_outputs("probabilistic", q_mode, block, entropy=(0.95, 1.0))[0]))
        < MIN_PVALUE
    )


def test_block_verify_accepts_more_per_step_than_token_verification():
    # the paper's claim, with a real draft distribution (one-hot drafts gain little: 0.142 vs 0.141 here)
    _, block = _markov_outputs("probabilistic", "q", block=True, length=60, n=4000, k=4)
    _, token = _markov_outputs("probabilistic", "q", length=60, n=4000, k=4)
    # measured 1.51 vs 1.31 accepted drafts per step
    assert block > token * 1.1


def test_entropy_thresholds():
    uniform = torch.full((1, 1, 4), 0.25, dtype=torch.float64)
    sure = torch.tensor([[[1.0, 0, 0, 0]]], dtype=torch.float64)
    # [1, 2]
    t = entropy_thresholds(torch.cat([uniform, sure], 1), 0.95, 0.4)
    assert t[0, 0].item() == pytest.approx(4**-0.4) and t[0, 1].item() == pytest.approx(0.95)
    # alpha 0: the threshold itself
    assert entropy_thresholds(uniform, 0.95, 0.0).item() == pytest.approx(0.95)


def test_block_and_entropy_verify_make_no_host_sync():
    B, K, meta = 4, 3, {"device": "meta"}
    probs = torch.empty(B, K + 1, V, **meta)
    for dp in (torch.empty(B, K, V, **meta), None):
        out, na = rejection_sample(
            "probabilistic",
            torch.empty(B, K, dtype=torch.long, **meta),
            probs,
            torch.empty(B, dtype=torch.bool, **meta),
            draft_probs=dp,
            uniform_samples=torch.empty(B, K, **meta),
            sample_u=torch.empty(B, K + 1, **meta),
            block=True,
            thresholds=entropy_thresholds(probs[:, :K], 0.95, 0.4),
        )
        assert out.shape == (B, K + 1) and na.shape == (B,)


def test_block_and_entropy_need_probabilistic():
    d, p = _t([[1]]), torch.full((1, 2, V), 1.0 / V)
    for kw in ({"block": True}, {"thresholds": torch.ones(1, 1)}):
        with pytest.raises(ValueError, match="probabilistic"):
            rejection_sample("strict", d, p, sample_u=torch.zeros(1, 2), **kw)


def test_which_rules_let_the_next_token_judge_a_one_hot_draft():
    from verispec.sample.metadata import VerifyRule

    assert VerifyRule().next_token_judges
    assert VerifyRule("probabilistic").next_token_judges
    assert not VerifyRule("synthetic", synthetic_acceptance_rate=0.5).next_token_judges
    assert not VerifyRule("probabilistic", block=True).next_token_judges
    assert not VerifyRule("probabilistic", entropy=(0.9, 0.3)).next_token_judges


def test_which_rules_are_lossy_by_design():
    """The rules whose output law is not the target's by design, which `verispec audit` fails."""
    from verispec.sample.metadata import VerifyRule

    lossless = (VerifyRule(), VerifyRule("probabilistic"), VerifyRule("probabilistic", block=True))
    assert all(rule.lossy_reason is None for rule in lossless)
    assert "'synthetic'" in VerifyRule("synthetic", synthetic_acceptance_rate=0.5).lossy_reason
    assert "enable_entropy_verify" in VerifyRule("probabilistic", entropy=(0.9, 0.3)).lossy_reason
