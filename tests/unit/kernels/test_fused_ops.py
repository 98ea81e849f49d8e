"""verispec/kernels/ops: each fused CPU op equals its PyTorch reference (the fallback path)."""

from __future__ import annotations

import pytest
import torch

from verispec.audit import chi2_pvalue
from verispec.kernels import ops
from verispec.kernels.qweight import kernels_available
from verispec.layers.attention import attention as torch_attention
from verispec.layers.norm import RMSNorm
from verispec.layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq
from verispec.sample import verify

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no AVX2/FMA CPU or no C compiler")
gen = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=gen)


# 75 rows: split over the threads
@pytest.mark.parametrize("n", [7, 75])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(with_residual, n):
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = rand(64)
    h, a = rand(n, 64), rand(n, 64)
    s, out = ops.add_rmsnorm(h, a if with_residual else None, norm.weight, 1e-6)
    ref_s = h + a if with_residual else h
    assert torch.equal(s, ref_s)
    torch.testing.assert_close(out, norm.reference(ref_s), rtol=1e-5, atol=1e-5)


# 67: a scalar tail; 300 x 256: threaded
@pytest.mark.parametrize(("n", "i"), [(5, 48), (3, 67), (300, 256)])
def test_silu_mul(n, i):
    x = rand(n, 2 * i) * 6
    # exp over- and underflow
    x[0, :6] = torch.tensor([-1e4, -100.0, -88.5, 88.5, 100.0, 1e4])
    out = ops.silu_mul(x)
    torch.testing.assert_close(out, torch.nn.functional.silu(x[:, :i]) * x[:, i:], rtol=2e-6, atol=1e-6)
    # a row does not depend on the others
    assert torch.equal(ops.silu_mul(x[1:2]), out[1:2])


# 68 rows: split over the threads
@pytest.mark.parametrize(("s", "q"), [(3, 4), (4, 17)])
def test_rope_in_place_matches_reference(s, q):
    h, d = 5, 32
    # a strided view, like the fused qkv
    x = rand(s, q, h + 2, d).transpose(1, 2)
    cos, ssin = rope_cos_sin(torch.arange(s * q).view(s, q) + 7, rope_inv_freq(d, 10000.0))
    ref = apply_rope(x[:, :h].clone(), cos, ssin)
    untouched = x[:, h:].clone()
    assert ops.rope_(x[:, :h], cos, ssin)
    torch.testing.assert_close(x[:, :h], ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(x[:, h:], untouched)


# 3 x 16 rows: one sequence per thread
@pytest.mark.parametrize("q", [2, 16])
def test_write_kv_matches_index_put(q):
    cache = rand(4, 6, 40, 16)
    # [S=3, H=6, Q, D]
    x = rand(3, q, 6, 16).transpose(1, 2)
    # [S, Q]
    pos = torch.stack([torch.arange(q) + o for o in (3, 0, 40 - q)])
    ref = cache.clone()
    ref[1:4][torch.arange(3).view(3, 1), :, pos] = x.transpose(1, 2)
    assert ops.write_kv(cache[1:4], x, pos)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize(
    ("s", "q", "t", "d"), [(1, 1, 9, 32), (3, 5, 17, 64), (2, 4, 300, 96), (2, 3, 40, 256)]
)
def test_attention_matches_sdpa(s, q, t, d, softcap):
    hq, hkv = 6, 2
    # strided like the decoder's view
    qt = rand(s, q, hq + 2 * hkv, d).transpose(1, 2)[:, :hq]
    cache = rand(s, 2 * hkv, t + 5, d)[:, :, :t]
    k, v = cache[:, :hkv], cache[:, hkv:]
    # the last q positions are the new tokens
    causal = torch.ones(q, t, dtype=torch.bool).tril(t - q)
    mask = causal.expand(s, 1, q, t).clone()
    # an arbitrary tree-style hole
    mask[0, 0, 0, 2] = False
    out = ops.attention(qt, k, v, mask, 0.125, softcap)
    ref = torch_attention(qt, k, v, mask, 0.125, softcap).transpose(1, 2).reshape(s, q, hq * d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    one = ops.attention(qt[:1], k[:1], v[:1], mask[:1], 0.125, softcap)
    # a row does not depend on the others
    assert torch.equal(one, out[:1])
    # nor on how many (masked-off) cache positions the view spans: T is the batch's longest context
    wide = torch.cat([cache, rand(s, 2 * hkv, 11, d)], dim=2)
    wide_mask = torch.cat([mask, torch.zeros(s, 1, q, 11, dtype=torch.bool)], dim=-1)
    assert torch.equal(ops.attention(qt, wide[:, :hkv], wide[:, hkv:], wide_mask, 0.125, softcap), out)


def _scattered(cache: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cache [S, H, T, D] laid out as a paged cache: (pool [blocks, H, bs, D] with each sequence's blocks in a
    shuffled order behind a null block, table [S, T / bs])."""
    s, h, t, d = cache.shape
    n = t // bs
    g = torch.Generator().manual_seed(n)
    order = torch.randperm(s * n, generator=g) + 1
    pool = torch.randn(s * n + 1, h, bs, d, generator=g)
    table = order.view(s, n)
    # [S, n, H, bs, D]
    pool[table] = cache.view(s, h, n, bs, d).transpose(1, 2)
    return pool, table


@pytest.mark.parametrize("bs", [8, 16, 64])
@pytest.mark.parametrize(("s", "q", "t"), [(1, 1, 64), (3, 5, 128), (2, 12, 320)])
def test_paged_attention_equals_the_contiguous_cache(s, q, t, bs, softcap=None):
    """The same keys read through a block table give bitwise the same output as from one contiguous view."""
    hq, hkv, d = 6, 2, 64
    # its own generator: the other tests' random cases stay as they were
    g = torch.Generator().manual_seed(s * q)
    qt = torch.randn(s, hq, q, d, generator=g)
    cache = torch.randn(s, 2 * hkv, t, d, generator=g)
    pool, table = _scattered(cache, bs)
    kv_len = t - 3
    mask = torch.ones(q, kv_len, dtype=torch.bool).tril(kv_len - q).expand(s, 1, q, kv_len).clone()
    contiguous = ops.attention(qt, cache[:, :hkv, :kv_len], cache[:, hkv:, :kv_len], mask, 0.125, 30.0)
    shift = bs.bit_length() - 1
    paged = ops.attention(qt, pool[:, :hkv], pool[:, hkv:], mask, 0.125, 30.0, None, (table, shift, kv_len))
    assert torch.equal(paged, contiguous)


@pytest.mark.parametrize("bs", [8, 16])
def test_paged_write_kv_lands_in_the_tables_blocks(bs):
    s, h, q, d, t = 3, 4, 5, 16, 64
    cache = torch.zeros(s, h, t, d)
    pool, table = _scattered(cache, bs)
    x = torch.randn(s, q, h, d, generator=torch.Generator().manual_seed(bs)).transpose(1, 2)
    pos = torch.stack([torch.arange(q) + o for o in (0, bs - 2, t - q)])
    ref = cache.clone()
    ref[torch.arange(s).view(s, 1), :, pos] = x.transpose(1, 2)
    assert ops.write_kv(pool, x, pos, None, (table, bs.bit_length() - 1))
    back = pool[table].transpose(1, 2).reshape(s, h, t, d)
    assert torch.equal(back, ref)


NARROW = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("bs", [8, 16])
def test_write_kv_into_a_narrow_cache_rounds_as_torch(dtype, bs):
    """kv_cache_dtype float16 / bfloat16: the kernel's write stores what torch's conversion gives (round to
    nearest even), overflow and subnormals included."""
    s, h, q, d, t = 3, 4, 5, 16, 64
    pool, table = _scattered(torch.zeros(s, h, t, d), bs)
    pool = pool.to(dtype)
    x = torch.randn(s, q, h, d, generator=torch.Generator().manual_seed(bs)).transpose(1, 2) * 3
    x[0, 0, 0, :5] = torch.tensor([1e6, -1e6, 1e-8, -3e-41, 65519.0])
    pos = torch.stack([torch.arange(q) + o for o in (0, bs - 2, t - q)])
    ref = pool.clone()
    blk, row = table.gather(1, pos // bs), pos % bs
    ref[blk, :, row] = x.transpose(1, 2).to(dtype)
    assert ops.write_kv(pool, x, pos, None, (table, bs.bit_length() - 1))
    assert torch.equal(pool.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize(("s", "q", "t", "d"), [(1, 1, 48, 64), (3, 5, 128, 128), (2, 12, 96, 72)])
def test_attention_over_a_narrow_cache_is_the_float32_attention_of_its_values(dtype, s, q, t, d):
    """A float16 / bfloat16 cache's attention is bitwise the float32 kernel's over the same keys widened: only the
    loads differ."""
    hq, hkv, bs = 6, 2, 16
    g = torch.Generator().manual_seed(s * q + d)
    qt = torch.randn(s, hq, q, d, generator=g)
    cache = torch.randn(s, 2 * hkv, t, d, generator=g).to(dtype)
    pool, table = _scattered(cache.float(), bs)
    narrow = pool.to(dtype)
    kv_len = t - 3
    mask = torch.ones(q, kv_len, dtype=torch.bool).tril(kv_len - q).expand(s, 1, q, kv_len).clone()
    paged = (table, bs.bit_length() - 1, kv_len)
    wide = ops.attention(qt, pool[:, :hkv], pool[:, hkv:], mask, 0.125, None, None, paged)
    out = ops.attention(
        qt, narrow[:, :hkv], narrow[:, hkv:], mask, 0.125, 30.0 if d == 72 else None, None, paged
    )
    if d != 72:
        assert torch.equal(out, wide)
    ref = torch_attention(
        qt,
        cache[:, :hkv, :kv_len].float(),
        cache[:, hkv:, :kv_len].float(),
        mask,
        0.125,
        30.0 if d == 72 else None,
    )
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(s, q, hq * d), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("q", "t", "hq", "hkv"), [(5, 300, 9, 3), (20, 64, 6, 2), (3, 40, 10, 2)])
def test_attention_row_does_not_depend_on_its_neighbours(q, t, hq, hkv):
    # a thread takes a sequence's consecutive query rows together (up to 8): each row must come out as it does alone,
    # whatever rows share its call and however many threads split them
    d = 64
    qt = rand(2, hq, q, d)
    cache = rand(2, 2 * hkv, t, d)
    k, v = cache[:, :hkv], cache[:, hkv:]
    mask = torch.ones(q, t, dtype=torch.bool).tril(t - q).expand(2, 1, q, t).clone()
    # a row with nothing to attend to, and holes that end rows at different 4-key groups
    mask[1, 0, 1] = False
    mask[0, 0, 2, t - q - 9 :] = False
    out = ops.attention(qt, k, v, mask, 0.125, None)
    for r in range(q):
        alone = ops.attention(qt[:, :, r : r + 1], k, v, mask[:, :, r : r + 1], 0.125, None)
        assert torch.equal(alone, out[:, r : r + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.attention(qt, k, v, mask, 0.125, None), out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[1, 1], torch.zeros(hq * d))


def test_padding_rows_are_skipped():
    """qlen: RoPE, the KV write and attention compute each sequence's real rows exactly as without it and leave the
    padding alone (a batch verifying one request's drafts pads every other sequence to its rows)."""
    s, q, hq, hkv, d, t = 4, 9, 6, 2, 32, 50
    qlen = torch.tensor([1, 9, 0, 3])
    real = torch.arange(q)[None] < qlen[:, None]
    # RoPE: real rows as with no qlen, padding rows unchanged
    x = rand(s, q, hq, d).transpose(1, 2)
    cos, ssin = rope_cos_sin(torch.arange(s * q).view(s, q), rope_inv_freq(d, 10000.0))
    full, part = x.clone(), x.clone()
    assert ops.rope_(full, cos, ssin) and ops.rope_(part, cos, ssin, qlen)
    assert torch.equal(part.transpose(1, 2)[real], full.transpose(1, 2)[real])
    assert torch.equal(part.transpose(1, 2)[~real], x.transpose(1, 2)[~real])
    # KV write: padding rows write nothing
    cache = torch.zeros(s, 2 * hkv, t, d)
    kv = rand(s, q, 2 * hkv, d).transpose(1, 2)
    pos = torch.arange(q).repeat(s, 1) + 40
    assert ops.write_kv(cache, kv, pos, qlen)
    written = cache.abs().sum(dim=(1, 3)) > 0
    assert torch.equal(written[:, 40:49], real) and not written[:, :40].any()
    # attention: real rows bitwise as with no qlen
    cache = rand(s, 2 * hkv, t, d)
    qt = rand(s, hq, q, d)
    mask = torch.ones(q, t, dtype=torch.bool).tril(t - q).expand(s, 1, q, t).clone()
    args = (qt, cache[:, :hkv], cache[:, hkv:], mask, 0.125, None)
    out, skipped = ops.attention(*args), ops.attention(*args, qlen)
    assert torch.equal(skipped[real], out[real])
    # a qlen of the wrong shape or type: not applicable
    assert ops.attention(*args, qlen[:2]) is None
    assert not ops.rope_(x, cos, ssin, qlen.int())


def test_attention_fully_masked_row_is_zero():
    qt, cache = rand(1, 2, 1, 16), rand(1, 2, 5, 16)
    mask = torch.zeros(1, 1, 1, 5, dtype=torch.bool)
    assert torch.equal(ops.attention(qt, cache[:, :1], cache[:, 1:], mask, 0.25, None), torch.zeros(1, 1, 32))


def test_inapplicable_inputs_fall_back():
    assert ops.silu_mul(rand(2, 8).double()) is None
    # D % 8 != 0
    assert ops.add_rmsnorm(rand(2, 12), None, rand(12), 1e-6) is None


@pytest.mark.parametrize(("n", "v"), [(1, 7), (3, 49152), (8, 1000), (2, 8)])
def test_argmax_matches_torch(n, v):
    x = rand(n, v)
    # a clear winner
    x[0, v // 2] = x[0].max() + 1
    if n > 1:
        x[1, :] = 0.0
        # a tie: the first index wins
        x[1, v - 1] = x[1, 3] = 2.0
    if n > 2:
        # nothing finite: index 0
        x[2, :] = float("-inf")
    got = ops.argmax(x)
    assert torch.equal(got, x.argmax(dim=-1))
    # strided rows
    assert torch.equal(ops.argmax(x[::2]), x[::2].argmax(dim=-1))


def test_argmax_nan_counts_as_largest():
    x = rand(2, 100)
    x[0, 41] = x[0, 77] = float("nan")
    # in the scalar tail of an 8-lane pass
    x[1, 99] = float("nan")
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))
    assert ops.argmax(x).tolist() == [41, 99]


# ---------------------------------------------------------------------------- sampled verification


def _ragged(b: int, k: int, v: int, sharp: float = 4.0):
    """A step's ragged logits [N, V], the row map [B, K+1], drafts [B, K] (-1 padded: request i drafts i % (K+1)
    tokens) that are the row's argmax except every third, and the padded [B, K+1, V] view of the same rows."""
    n_drafts = [i % (k + 1) for i in range(b)]
    x = rand(sum(n + 1 for n in n_drafts), v) * sharp
    starts = torch.tensor([0] + [n + 1 for n in n_drafts[:-1]]).cumsum(0)
    offs = torch.minimum(torch.arange(k + 1)[None], torch.tensor(n_drafts)[:, None])
    rows = starts[:, None] + offs
    drafts = torch.full((b, k), -1, dtype=torch.long)
    for i, n in enumerate(n_drafts):
        for j in range(n):
            best = int(x[rows[i, j]].argmax())
            drafts[i, j] = best if (i + j) % 3 else (best + 1) % v
    return x, rows, drafts, x[rows.view(-1)].view(b, k + 1, v)


@pytest.mark.parametrize(("n", "v"), [(5, 7), (3, 49152), (16, 1000), (4, 24)])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_verify_sampled_without_drafts_samples_the_inverse_cdf(n, v, temperature):
    x = rand(n, v) * 3
    # a truncated row: its dropped tokens are never drawn
    x[0, : v // 2] = float("-inf")
    u = torch.rand(n, 1, generator=gen)
    tok, acc = ops.verify_sampled(
        x,
        torch.arange(n)[:, None],
        torch.empty(n, 0, dtype=torch.long),
        torch.full((n,), 1 / temperature),
        None,
        u,
    )
    assert acc.tolist() == [0] * n
    # [N, V] float64 reference
    cdf = (x.double() / temperature).softmax(-1).cumsum(-1)
    point = u.double() * cdf[:, -1:]
    below = cdf.gather(1, (tok - 1).clamp_min(0)[:, None]).where(tok[:, None] > 0, torch.zeros(n, 1).double())
    assert (below <= point + 1e-6).all() and (cdf.gather(1, tok[:, None]) >= point - 1e-6).all()
    assert (tok[0] >= v // 2).all()


@pytest.mark.parametrize("rule", ["strict", "probabilistic"])
@pytest.mark.parametrize(("b", "k", "v"), [(6, 4, 1000), (9, 2, 49152), (4, 1, 13)])
def test_verify_sampled_equals_the_dense_rule(rule, b, k, v):
    """The kernel walks each request's rows only to its first rejection; the dense rules score every position:
    the same tokens and acceptance for the same uniforms."""
    x, rows, drafts, padded = _ragged(b, k, v)
    u_sample, u_accept = torch.rand(b, k + 1, generator=gen), torch.rand(b, k, generator=gen)
    scale = torch.full((b,), 1 / 0.8)
    probs = (padded / 0.8).softmax(-1)
    if rule == "strict":
        want = verify.strict_verify(drafts, probs, u_sample)
        tok, acc = ops.verify_sampled(x, rows, drafts, scale, None, u_sample)
    else:
        want = verify.probabilistic_verify(drafts, probs, None, u_accept, u_sample)
        tok, acc = ops.verify_sampled(x, rows, drafts, scale, u_accept, u_sample)
    got = verify.assemble_at(drafts, acc, tok[:, None])
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    # the sharp logits make some requests accept drafts and others reject them
    assert 0 < int(acc.sum()) < int((drafts >= 0).sum())


@pytest.mark.parametrize(("b", "k", "v"), [(6, 4, 1000), (9, 2, 49152), (4, 1, 13), (3, 0, 24)])
def test_verify_greedy_equals_the_tensor_rule(b, k, v):
    """The kernel takes the argmax of each request's rows only up to its first rejection; the tensor rule takes
    every row's: the same emitted token and acceptance."""
    x, rows, drafts, padded = _ragged(b, k, v)
    # a tie inside a row: the first index of the maximum, as torch.argmax
    x[rows[0, 0], 1:3] = x[rows[0, 0]].max() + 1
    want = verify.greedy_verify(drafts, x.argmax(-1)[rows])
    tok, acc = ops.verify_greedy(x, rows, drafts)
    got = verify.assemble_at(drafts, acc, tok[:, None])
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    if k > 1:
        # drafts that are the argmax except every third: some requests accept, others reject
        assert 0 < int(acc.sum()) < int((drafts >= 0).sum())


def test_verify_greedy_falls_back_off_cpu_float32():
    x = rand(4, 8).double()
    assert ops.verify_greedy(x, torch.arange(4).view(2, 2), torch.zeros(2, 1, dtype=torch.long)) is None


@pytest.mark.parametrize("rule", ["strict", "probabilistic"])
def test_verify_sampled_keeps_the_target_law(rule):
    """One draft per request, always the same token: the first emitted token (the accepted draft or the
    replacement) follows the target distribution exactly (chi-square), and a wrong law is rejected."""
    n, v = 20000, 11
    logits = rand(v) * 1.5
    x = logits.expand(2 * n, v).contiguous()
    rows = torch.arange(2 * n).view(n, 2)
    drafts = torch.full((n, 1), int(logits.argsort()[-2]))
    u_sample, u_accept = torch.rand(n, 2, generator=gen), torch.rand(n, 1, generator=gen)
    tok, acc = ops.verify_sampled(
        x, rows, drafts, torch.ones(n), None if rule == "strict" else u_accept, u_sample
    )
    first = torch.where(acc > 0, drafts[:, 0], tok)
    counts = torch.bincount(first, minlength=v).double()
    p = logits.double().softmax(-1)
    assert chi2_pvalue(counts, p) > 1e-4
    assert chi2_pvalue(counts, (0.8 * p + 0.2 / v)) < 1e-4


def test_verify_sampled_falls_back_off_cpu_float32():
    b, k = 2, 1
    x = rand(b * 2, 8).double()
    rows = torch.arange(b * 2).view(b, 2)
    assert (
        ops.verify_sampled(
            x, rows, torch.zeros(b, k, dtype=torch.long), torch.ones(b), None, torch.rand(b, 2)
        )
        is None
    )
