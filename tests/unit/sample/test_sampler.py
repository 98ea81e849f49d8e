import math

import pytest
import torch

from verispec.audit import chi2_pvalue
from verispec.sample.logits import (
    SamplingTensors,
    apply_penalties,
    compute_logprobs,
    draft_aware_counts,
    draw_noise,
    draw_row_uniforms,
    greedy,
    greedy_or_sample,
    logits_to_probs,
    make_generator,
    position_uniforms,
    sample,
    sample_key,
)
from verispec.sampling_params import SamplingParams

# Token probabilities, deliberately not sorted by id: ranking is 1 > 3 > 4 > 0 > 2.
PROBS5 = [0.1, 0.4, 0.05, 0.3, 0.15]
LOGITS5 = [math.log(p) for p in PROBS5]
ALL = {0, 1, 2, 3, 4}


def sample_tokens(logits, st, noise, prompt_mask=None, output_counts=None):
    """Plain decoding's pipeline: penalties, then greedy rows' argmax and random rows' samples."""
    if st.any_penalties:
        logits = apply_penalties(logits, prompt_mask, output_counts, st)
    probs = None if st.all_greedy else logits_to_probs(logits, st)
    return greedy_or_sample(greedy(logits), probs, noise, st.is_greedy), probs


FILTER_CASES = [
    # (SamplingParams kwargs, logits, expected kept token ids)
    ({}, LOGITS5, ALL),
    ({"top_k": 1}, LOGITS5, {1}),
    ({"top_k": 2}, LOGITS5, {1, 3}),
    ({"top_k": 4}, LOGITS5, {0, 1, 3, 4}),
    ({"top_k": 5}, LOGITS5, ALL),
    ({"top_k": 100}, LOGITS5, ALL),
    ({"top_k": 0}, LOGITS5, ALL),
    ({"top_k": -1}, LOGITS5, ALL),
    # ties with the k-th value are kept
    ({"top_k": 2}, [1.0, 1.0, 1.0, 0.0, -1.0], {0, 1, 2}),
    ({"top_p": 0.01}, LOGITS5, {1}),
    ({"top_p": 0.3}, LOGITS5, {1}),
    ({"top_p": 0.5}, LOGITS5, {1, 3}),
    ({"top_p": 0.8}, LOGITS5, {1, 3, 4}),
    ({"top_p": 0.9}, LOGITS5, {0, 1, 3, 4}),
    ({"top_p": 0.97}, LOGITS5, ALL),
    # top-p on the top-k-renormalised distribution
    ({"top_k": 3, "top_p": 0.6}, LOGITS5, {1, 3}),
    ({"top_k": 2, "top_p": 0.9}, LOGITS5, {1, 3}),
    # threshold 0.12
    ({"min_p": 0.3}, LOGITS5, {1, 3, 4}),
    # threshold 0.2
    ({"min_p": 0.5}, LOGITS5, {1, 3}),
    ({"min_p": 1.0}, LOGITS5, {1}),
    ({"min_p": 0.3, "top_k": 4}, LOGITS5, {1, 3, 4}),
    # threshold 0.08
    ({"min_p": 0.2, "top_k": 4}, LOGITS5, {0, 1, 3, 4}),
    # p^2: 0.16/0.285 = 0.56 < 0.6
    ({"temperature": 0.5, "top_p": 0.6}, LOGITS5, {1, 3}),
    # greedy: no filter
    ({"temperature": 0.0, "top_k": 1, "top_p": 0.1, "min_p": 0.9}, LOGITS5, ALL),
]


def _st(params: list[SamplingParams], vocab_size: int) -> SamplingTensors:
    return SamplingTensors.from_params(params, "cpu", vocab_size)


def test_filter_table_batched():
    params = [SamplingParams(**kw) for kw, _, _ in FILTER_CASES]
    # [N, 5]
    logits = torch.tensor([lg for _, lg, _ in FILTER_CASES])
    st = _st(params, 5)
    probs = logits_to_probs(logits, st)
    assert probs.dtype == torch.float32
    for row, (kw, lg, kept) in enumerate(FILTER_CASES):
        got = set(torch.nonzero(probs[row] > 0).flatten().tolist())
        assert got == kept, (kw, got, kept)
        t = 1.0 if kw.get("temperature", 1.0) == 0.0 else kw.get("temperature", 1.0)
        ref = torch.softmax(torch.tensor(lg) / t, -1)
        mask = torch.tensor([i in kept for i in range(5)])
        ref = torch.where(mask, ref, 0.0)
        torch.testing.assert_close(probs[row], ref / ref.sum(), msg=str(kw))


@pytest.mark.parametrize("case", FILTER_CASES, ids=lambda c: str(c[0]))
def test_filter_row_alone_equals_row_in_batch(case):
    """A row's distribution must not depend on what else is in the batch (lossless verification)."""
    kw, lg, _ = case
    params = [SamplingParams(**kw)]
    alone = logits_to_probs(torch.tensor([lg]), _st(params, 5))
    others = [SamplingParams(top_k=2, top_p=0.7, min_p=0.1), SamplingParams(temperature=0.3)]
    batch = logits_to_probs(torch.tensor([LOGITS5, lg, LOGITS5]), _st([others[0], params[0], others[1]], 5))
    assert torch.equal(alone[0], batch[1])


def test_flags_disable_features():
    st = _st([SamplingParams(), SamplingParams(temperature=0.0, top_k=3, min_p=0.5)], 10)
    assert not (st.all_greedy or st.any_penalties or st.any_top_k or st.any_top_p or st.any_min_p)
    assert st.top_k.tolist() == [10, 10] and st.temperature.tolist() == [1.0, 1.0]
    st = _st([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, presence_penalty=0.5)], 10)
    assert st.all_greedy and st.any_penalties and st.is_greedy.tolist() == [True, True]
    st = _st([SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(min_p=0.1)], 10)
    assert st.any_top_k and st.any_top_p and st.any_min_p and not st.all_greedy
    assert st.top_k.tolist() == [3, 10, 10]


def test_repeat_interleave_matches_per_row_params():
    params = [
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
    ]
    counts = [3, 1]
    expanded = _st(params, 8).repeat_interleave(counts)
    direct = _st([p for p, c in zip(params, counts) for _ in range(c)], 8)
    for name, v in vars(direct).items():
        got = getattr(expanded, name)
        assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, name
    again = _st(params, 8).repeat_interleave(torch.tensor(counts))
    assert torch.equal(again.top_k, direct.top_k)


BASE = [2.0, -1.0, 0.5, -0.5]
PENALTY_CASES = [
    # (kwargs, prompt tokens, output counts, expected logits)
    ({}, [0, 1], [1, 1, 0, 3], BASE),
    ({"repetition_penalty": 2.0}, [0], [0, 1, 0, 0], [1.0, -2.0, 0.5, -0.5]),
    ({"repetition_penalty": 0.5}, [2, 3], [0, 0, 0, 0], [2.0, -1.0, 1.0, -0.25]),
    # prompt is not counted
    ({"frequency_penalty": 0.5}, [0], [0, 2, 1, 0], [2.0, -2.0, 0.0, -0.5]),
    ({"frequency_penalty": -1.0}, [], [3, 0, 0, 0], [5.0, -1.0, 0.5, -0.5]),
    ({"presence_penalty": 0.5}, [3], [0, 2, 1, 0], [2.0, -1.5, 0.0, -0.5]),
    # presence ignores the prompt
    ({"presence_penalty": 1.0}, [2], [0, 0, 0, 0], BASE),
    (
        {"repetition_penalty": 2.0, "frequency_penalty": 0.1, "presence_penalty": 0.2},
        [3],
        [0, 2, 0, 0],
        [2.0, -2.4, 0.5, -1.0],
    ),
    ({"temperature": 0.0, "repetition_penalty": 4.0}, [0], [0, 0, 0, 0], [0.5, -1.0, 0.5, -0.5]),
]


def test_penalties_table():
    params = [SamplingParams(**kw) for kw, _, _, _ in PENALTY_CASES]
    n = len(PENALTY_CASES)
    logits = torch.tensor([BASE] * n)
    prompt_mask = torch.zeros(n, 4, dtype=torch.bool)
    for row, (_, prompt, _, _) in enumerate(PENALTY_CASES):
        prompt_mask[row, prompt] = True
    counts = torch.tensor([c for _, _, c, _ in PENALTY_CASES], dtype=torch.int32)
    out = apply_penalties(logits, prompt_mask, counts, _st(params, 4))
    expected = torch.tensor([e for _, _, _, e in PENALTY_CASES])
    torch.testing.assert_close(out, expected)


def _naive_draft_counts(counts: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    B, K = drafts.shape
    out = torch.zeros(B, K + 1, counts.shape[1], dtype=counts.dtype)
    for b in range(B):
        for j in range(K + 1):
            c = counts[b].clone()
            for i in range(j):
                if drafts[b, i] >= 0:
                    c[drafts[b, i]] += 1
            out[b, j] = c
    return out


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_draft_aware_counts_matches_naive(dtype):
    g = torch.Generator().manual_seed(0)
    # small V so drafts repeat tokens
    B, K, V = 6, 5, 7
    counts = torch.randint(0, 4, (B, V), generator=g).to(dtype)
    drafts = torch.randint(0, V, (B, K), generator=g)
    # ragged drafts, -1 padded
    drafts[1, 3:] = -1
    drafts[2, :] = -1
    # repeated draft token
    drafts[4, 1] = drafts[4, 0]
    got = draft_aware_counts(counts, drafts)
    assert got.shape == (B, K + 1, V) and got.dtype == dtype
    assert torch.equal(got, _naive_draft_counts(counts, drafts))
    assert torch.equal(got[:, 0], counts)


def test_draft_aware_penalties_equal_plain_decoding():
    """Penalised logits at verify position j == plain decoding after accepting drafts[:j]."""
    g = torch.Generator().manual_seed(1)
    V, K = 9, 3
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    logits = torch.randn(K + 1, V, generator=g)
    counts = torch.randint(0, 2, (1, V), generator=g)
    prompt = torch.rand(1, V, generator=g) < 0.3
    drafts = torch.tensor([[4, 4, 1]])
    rows = draft_aware_counts(counts, drafts).reshape(K + 1, V)
    st_rows = _st([p], V).repeat_interleave([K + 1])
    verify = apply_penalties(logits, prompt.expand(K + 1, V), rows, st_rows)
    running = counts.clone()
    for j in range(K + 1):
        plain = apply_penalties(logits[j : j + 1], prompt, running, _st([p], V))
        assert torch.equal(plain[0], verify[j])
        if j < K:
            running[0, drafts[0, j]] += 1


def _run_request(
    target_seed: int, others: list[tuple[int, int | None]], place: int, steps: int = 4
) -> list[list[int]]:
    """Sample `steps` steps for a seeded 3-row request placed at `place` among `others`."""
    V = 64
    gen_logits = torch.Generator().manual_seed(123)
    target_logits = [torch.randn(3, V, generator=gen_logits) for _ in range(steps)]
    reqs = list(others)
    reqs.insert(place, (3, target_seed))
    generators = [make_generator(s, "cpu") if s is not None else None for _, s in reqs]
    n_rows = [n for n, _ in reqs]
    params = [SamplingParams(temperature=1.5, top_k=40, seed=s) for _, s in reqs]
    st = _st(params, V).repeat_interleave(n_rows)
    start = sum(n_rows[:place])
    out = []
    for step in range(steps):
        # other rows: arbitrary logits
        logits = torch.randn(sum(n_rows), V)
        logits[start : start + 3] = target_logits[step]
        noise = draw_row_uniforms(n_rows, generators, "cpu")
        tokens, _ = sample_tokens(logits, st, noise)
        out.append(tokens[start : start + 3].tolist())
    return out


def test_seeded_request_independent_of_batch():
    alone = _run_request(42, [], 0)
    others = [(1, 7), (2, None), (1, None), (4, 99), (1, 42), (2, None), (3, 5)]
    for place in (0, 3, 7):
        assert _run_request(42, others, place) == alone
    # the seed actually matters
    assert _run_request(43, [], 0) != alone


def test_draw_noise_unseeded_uses_default_generator():
    n_rows, gens = [2, 1, 3], [None, make_generator(3, "cpu"), None]
    a = draw_noise(n_rows, gens, 10, "cpu", default_generator=torch.Generator().manual_seed(5))
    gens[1] = make_generator(3, "cpu")
    b = draw_noise(n_rows, gens, 10, "cpu", default_generator=torch.Generator().manual_seed(5))
    assert a.shape == (6, 10) and torch.equal(a, b) and bool((a > 0).all())
    shared = torch.empty(5, 10).exponential_(generator=torch.Generator().manual_seed(5))
    assert torch.equal(a[:2], shared[:2]) and torch.equal(a[3:], shared[2:])
    assert torch.equal(a[2:3], torch.empty(1, 10).exponential_(generator=make_generator(3, "cpu")))


def test_draw_row_uniforms_unseeded_use_default_generator():
    n_rows, gens = [2, 1, 3], [None, make_generator(3, "cpu"), None]
    a = draw_row_uniforms(n_rows, gens, "cpu", default_generator=torch.Generator().manual_seed(5))
    gens[1] = make_generator(3, "cpu")
    b = draw_row_uniforms(n_rows, gens, "cpu", default_generator=torch.Generator().manual_seed(5))
    assert a.shape == (6,) and torch.equal(a, b) and bool(((a >= 0) & (a < 1)).all())
    assert torch.equal(a[2:3], torch.rand(1, generator=make_generator(3, "cpu")))


def test_sample_follows_probs_chi_square():
    probs = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.2, 0.3])
    n = 50_000
    noise = draw_row_uniforms([n], [make_generator(0, "cpu")], "cpu")
    tokens = sample(probs.expand(n, 6), noise)
    observed = torch.bincount(tokens, minlength=6).double()
    expected = probs.double() * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # df=5, p=0.001
    assert chi2 < 20.52, chi2
    # unnormalised input gives the same draw (the inverse CDF scales u by the total)
    assert torch.equal(sample(probs.expand(n, 6) * 4.0, noise), tokens)


def test_sample_never_picks_zero_prob():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]])
    g = make_generator(1, "cpu")
    for _ in range(50):
        noise = draw_row_uniforms([2], [g], "cpu")
        t = sample(probs, noise)
        assert t[0] in (1, 3) and t[1] == 2


def test_greedy_and_sample_tokens_mixed_batch():
    V = 6
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0, 0.0, 0.0]] * 3)
    params = [
        # penalty flips the argmax to 2
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0),
        # sampled, top-1 after penalty
        SamplingParams(temperature=1.0, top_k=1, repetition_penalty=2.0),
    ]
    prompt_mask = torch.zeros(3, V, dtype=torch.bool)
    prompt_mask[:, 1] = True
    counts = torch.zeros(3, V, dtype=torch.int64)
    st = _st(params, V)
    noise = draw_row_uniforms([3], [None], "cpu", torch.Generator().manual_seed(0))
    tokens, probs = sample_tokens(logits, st, noise, prompt_mask, counts)
    assert tokens.tolist() == [2, 1, 2]
    assert probs is not None and probs.shape == (3, V)
    assert torch.equal(greedy(logits), torch.tensor([1, 1, 1]))


def test_sample_tokens_all_greedy_needs_no_noise():
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, 0.0, 1.0]])
    tokens, probs = sample_tokens(logits, _st([SamplingParams(temperature=0.0)] * 2, 3), None)
    assert tokens.tolist() == [1, 0] and probs is None


def test_compute_logprobs_matches_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 20, generator=g)
    tokens = torch.randint(0, 20, (5,), generator=g)
    tokens[0] = logits[0].argmax()
    out = compute_logprobs(logits, tokens, num_top=3)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.token_logprob, ref[torch.arange(5), tokens], rtol=0, atol=0)
    ref_top = ref.topk(3, -1)
    assert torch.equal(out.top_ids, ref_top.indices)
    torch.testing.assert_close(out.top_logprobs, ref_top.values, rtol=0, atol=0)
    ranks = [int((ref[i] > ref[i, tokens[i]]).sum()) + 1 for i in range(5)]
    assert out.token_rank.tolist() == ranks and ranks[0] == 1
    empty = compute_logprobs(logits, tokens, num_top=0)
    assert empty.top_ids.shape == (5, 0)
    lp, ids, top_lp, rank = compute_logprobs(logits.to(torch.bfloat16), tokens, 2)
    assert lp.dtype == torch.float32 and ids.shape == (5, 2)


def test_position_uniforms_are_uniform_and_keyed_by_position():
    """24-bit uniforms in [0, 1): the same (key, position) gives the same value whatever else is asked for; the
    values look uniform and independent across positions and across nearby seeds."""
    keys = [sample_key(s) for s in range(64)]
    # [64, 2000]
    u = position_uniforms(keys, torch.arange(2000).expand(64, 2000))
    assert u.dtype == torch.float32 and 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert torch.equal(u * (1 << 24), (u * (1 << 24)).floor())
    # one request alone, at other positions: the same values
    assert torch.equal(position_uniforms(keys[5:6], torch.tensor([[7, 1999, 0]])), u[5, [7, 1999, 0]][None])
    counts = torch.histc(u, bins=20, min=0.0, max=1.0).double()
    assert chi2_pvalue(counts, torch.full((20,), 0.05, dtype=torch.float64)) > 1e-4
    # neighbours in position and in seed are uncorrelated
    assert abs(float(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1])) < 0.02
    assert abs(float(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1])) < 0.02
    assert len(set(keys)) == 64 and sample_key(-1) != sample_key(1)


def test_a_steps_few_uniforms_hashed_on_the_host_are_the_tensor_hash():
    """Up to 64 values are hashed in Python integers (cheaper than a dozen tensor ops); the bits must be the tensor
    path's, for any key (negative ones included) and position."""
    gen = torch.Generator().manual_seed(0)
    for b, n in [(1, 1), (1, 9), (4, 5), (16, 4), (8, 8)]:
        keys = torch.randint(-(1 << 63), (1 << 63) - 1, (b,), generator=gen).tolist()
        positions = torch.randint(0, 1 << 31, (b, n), generator=gen)
        host = position_uniforms(keys, positions)
        # the same rows inside a call too large for the host path
        wide = position_uniforms(keys * 70, positions.repeat(70, 1))[:b]
        assert positions.numel() <= 64 < positions.numel() * 70
        assert torch.equal(host, wide)
