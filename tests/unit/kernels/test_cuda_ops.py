"""The batch-invariant CUDA ops (verispec/kernels/cuda_ops.py).

Without a GPU their Triton kernels run through Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1): the same functions as PyTorch's, and the compaction that makes a tree node's attention equal
to a chain's. On a CUDA machine the kernels run on the GPU and the checks are bitwise: a row's result alone equals
its result in a batch.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from verispec.kernels import cuda_ops

CUDA = torch.cuda.is_available() and cuda_ops.HAVE_TRITON


def test_visible_keys_lists_each_querys_keys_in_order():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 1, 4, 11, generator=g) > 0.5
    mask[..., 2] = True
    idx, cnt = cuda_ops.visible_keys(mask, 11, mask.device)
    assert idx.shape == (3, 4, 11) and idx.dtype == torch.int32 and cnt.dtype == torch.int32
    for s in range(3):
        for q in range(4):
            keys = mask[s, 0, q].nonzero().flatten()
            assert cnt[s, q] == len(keys)
            assert idx[s, q, : len(keys)].tolist() == keys.tolist()
    idx, cnt = cuda_ops.visible_keys(None, 7, mask.device)
    assert idx.tolist() == [[list(range(7))]] and cnt.tolist() == [[7]]


@pytest.fixture(scope="module")
def interp(triton_interpreter):
    """cuda_ops with its kernels under Triton's interpreter (CPU tensors)."""
    return cuda_ops


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("d", [32, 40])
def test_add_rmsnorm_is_rmsnorm(interp, d):
    g = torch.Generator().manual_seed(d)
    h, a, w = torch.randn(5, d, generator=g), torch.randn(5, d, generator=g), torch.randn(d, generator=g)
    s, out = interp.add_rmsnorm(h, a, w, 1e-6)
    assert torch.equal(s, h + a)
    torch.testing.assert_close(out, _rmsnorm(h + a, w, 1e-6))
    # any leading shape (q / k norms over [S, H, Q, D] views)
    x = torch.randn(2, 3, 4, d, generator=g).transpose(1, 2)
    s, out = interp.add_rmsnorm(x, None, w, 1e-6)
    assert s.shape == x.shape and torch.equal(s, x)
    torch.testing.assert_close(out, _rmsnorm(x, w, 1e-6))
    # bfloat16 storage (the CUDA models'): the sum rounded as h + a rounds it, the norm computed in float32
    hb, ab, wb = h.bfloat16(), a.bfloat16(), w.bfloat16()
    s, out = interp.add_rmsnorm(hb, ab, wb, 1e-6)
    assert s.dtype == out.dtype == torch.bfloat16
    # (the interpreter rounds to bfloat16 towards zero, a GPU to nearest as PyTorch does: one unit apart at most)
    torch.testing.assert_close(s.float(), (hb + ab).float(), atol=0, rtol=2**-7)
    torch.testing.assert_close(
        out.float(), _rmsnorm((hb + ab).float(), wb.float(), 1e-6), atol=0.05, rtol=0.01
    )


def _reference_attention(q, k, v, mask, scale, softcap):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    s, hq, nq, d = q.shape
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(s, nq, hq * d)


@pytest.mark.parametrize("d,softcap", [(16, None), (24, None), (16, 5.0)])
def test_attention_is_masked_softmax_attention(interp, d, softcap):
    g = torch.Generator().manual_seed(d)
    s, hq, hkv, nq, t = 2, 4, 2, 3, 70
    q = torch.randn(s, hq, nq, d, generator=g)
    # a cache view: slots of a longer allocation, K heads then V heads
    cache = torch.randn(s, 2 * hkv, t + 9, d, generator=g)
    k, v = cache[:, :hkv, :t], cache[:, hkv:, :t]
    mask = torch.rand(s, 1, nq, t, generator=g) > 0.3
    mask[..., 0] = True
    out = interp.attention(q, k, v, 0.3, softcap, interp.visible_keys(mask, t, q.device))
    torch.testing.assert_close(out, _reference_attention(q, k, v, mask, 0.3, softcap))
    # no mask: one query, every key
    out = interp.attention(q[:1, :, :1], k[:1], v[:1], 0.3, softcap, interp.visible_keys(None, t, q.device))
    torch.testing.assert_close(out, _reference_attention(q[:1, :, :1], k[:1], v[:1], None, 0.3, softcap))


def _paged(seed: int, s: int, t: int, bs: int, dtype: torch.dtype, device: str = "cpu"):
    """Rows' K|V [S, 2Hkv, T, D] scattered over a paged cache [blocks, 2Hkv, bs, D] in a shuffled order, with
    noise in every block the table does not map -> (cache, block table rows [S, n], the rows' K|V)."""
    g = torch.Generator().manual_seed(seed)
    hkv, d = 2, 16
    n = -(-t // bs)
    cache = torch.randn(s * n + 3, 2 * hkv, bs, d, generator=g).to(dtype)
    blocks = torch.randperm(s * n + 3, generator=g)[: s * n].view(s, n)
    # [S, 2Hkv, n*bs, D] -> the first t positions
    kv = cache[blocks].transpose(1, 2).reshape(s, 2 * hkv, n * bs, d)[:, :, :t]
    return cache.to(device), blocks.to(device), kv.to(device)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_paged_attention_reads_the_blocks_in_place(interp, cache_dtype):
    """Through the block table: bitwise the attention over the gathered keys (float16 blocks widen exactly)."""
    s, hq, hkv, nq, t, bs = 3, 4, 2, 5, 53, 16
    cache, blocks, kv = _paged(1, s, t, bs, cache_dtype)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(s, hq, nq, 16, generator=g)
    mask = torch.rand(s, 1, nq, t, generator=g) > 0.4
    mask[..., 0] = True
    visible = interp.visible_keys(mask, t, q.device)
    paged = interp.attention(q, cache[:, :hkv], cache[:, hkv:], 0.3, None, visible, (blocks, 4))
    gathered = kv.float()
    k, v = gathered[:, :hkv], gathered[:, hkv:]
    assert torch.equal(paged, interp.attention(q, k, v, 0.3, None, visible))
    torch.testing.assert_close(paged, _reference_attention(q, k, v, mask, 0.3, None))
    # a strided view of the table (the rows of slots [lo, hi) of a wider one)
    wide = torch.cat((blocks, blocks.flip(0)), dim=1)[:, : blocks.shape[1]]
    assert torch.equal(
        paged, interp.attention(q, cache[:, :hkv], cache[:, hkv:], 0.3, None, visible, (wide, 4))
    )


def _tree_and_chain(seed: int, device: str = "cpu"):
    """A query whose visible keys are spread over the cache (a tree node: prefix, ancestors, siblings skipped) and
    the same query over the same keys laid out contiguously (the chain plain decoding sees)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, prefix = 4, 2, 16, 67
    visible = list(range(prefix)) + [prefix + 1, prefix + 4, prefix + 6]
    t = prefix + 8
    q = torch.randn(1, hq, 1, d, generator=g)
    k, v = torch.randn(1, hkv, t, d, generator=g), torch.randn(1, hkv, t, d, generator=g)
    mask = torch.zeros(1, 1, 1, t, dtype=torch.bool)
    mask[..., visible] = True
    n = len(visible)
    kc, vc = k[:, :, visible].contiguous(), v[:, :, visible].contiguous()
    to = dict(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    return (q.to(**to), k.to(**to), v.to(**to), mask.to(device)), (q.to(**to), kc.to(**to), vc.to(**to), n)


def test_a_tree_node_attends_like_its_chain(interp):
    """Bitwise: the visible keys are compacted, so the blocks the sums run over start at the same key."""
    (q, k, v, mask), (qc, kc, vc, n) = _tree_and_chain(0)
    tree = interp.attention(q, k, v, 0.25, None, interp.visible_keys(mask, k.shape[2], q.device))
    chain = interp.attention(qc, kc, vc, 0.25, None, interp.visible_keys(None, n, q.device))
    assert torch.equal(tree, chain)


def test_linear_is_x_at_w(interp):
    g = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(3, 50, 32, generator=g),
        torch.randn(24, 32, generator=g),
        torch.randn(24, generator=g),
    )
    torch.testing.assert_close(interp.linear(x, w, b), F.linear(x, w, b))
    # one-product calls reuse an input buffer: fewer rows than the last call, in inference mode or not
    with torch.inference_mode():
        torch.testing.assert_close(interp.linear(x[0, :5], w, None), F.linear(x[0, :5], w))
    with torch.no_grad():
        torch.testing.assert_close(interp.linear(x[1, :2], w, b), F.linear(x[1, :2], w, b))


# On the GPU: each row alone equals the same row in a batch, bitwise


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton")
@pytest.mark.parametrize("rows", [2, 5, 64, 130])
def test_cuda_linear_and_norm_are_batch_invariant(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 576, generator=g, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(rows, 576, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 576, generator=g, device="cuda", dtype=torch.bfloat16)
    wn = torch.randn(576, generator=g, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        batch = cuda_ops.linear(x, w, None)
        _, normed = cuda_ops.add_rmsnorm(x, a, wn, 1e-5)
        for r in (0, rows - 1):
            assert torch.equal(cuda_ops.linear(x[r : r + 1], w, None), batch[r : r + 1])
            assert torch.equal(
                cuda_ops.add_rmsnorm(x[r : r + 1], a[r : r + 1], wn, 1e-5)[1], normed[r : r + 1]
            )


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton")
def test_cuda_attention_is_batch_invariant():
    """A decoded query (alone, no mask, its own context length) equals the same query verified among 5 rows of a
    longer context, and a tree node equals its chain."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d, t = 9, 3, 64, 300
    kw = dict(generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v = torch.randn(2, hq, 5, d, **kw), torch.randn(2, hkv, t, d, **kw), torch.randn(2, hkv, t, d, **kw)
    start = 200
    # [2, 1, 5, T]: row j sees keys 0 .. start + j
    mask = (torch.arange(t, device="cuda")[None, :] <= start + torch.arange(5, device="cuda")[:, None])[
        None, None
    ]
    mask = mask.expand(2, 1, 5, t).contiguous()
    with torch.inference_mode():
        batch = cuda_ops.attention(q, k, v, 0.125, None, cuda_ops.visible_keys(mask, t, q.device))
        for s, j in ((0, 0), (1, 3)):
            n = start + j + 1
            alone = cuda_ops.attention(
                q[s : s + 1, :, j : j + 1],
                k[s : s + 1, :, :n],
                v[s : s + 1, :, :n],
                0.125,
                None,
                cuda_ops.visible_keys(None, n, q.device),
            )
            assert torch.equal(alone[0, 0], batch[s, j])
        (q, k, v, mask), (qc, kc, vc, n) = _tree_and_chain(1, "cuda")
        tree = cuda_ops.attention(q, k, v, 0.25, None, cuda_ops.visible_keys(mask, k.shape[2], q.device))
        chain = cuda_ops.attention(qc, kc, vc, 0.25, None, cuda_ops.visible_keys(None, n, q.device))
        assert torch.equal(tree, chain)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton")
def test_cuda_paged_attention_equals_the_gathered_one():
    s, hkv, nq, t = 4, 2, 3, 301
    cache, blocks, kv = _paged(3, s, t, 16, torch.bfloat16, "cuda")
    q = torch.randn(s, 6, nq, 16, device="cuda", dtype=torch.bfloat16)
    mask = (torch.arange(t, device="cuda")[None, :] <= t - nq + torch.arange(nq, device="cuda")[:, None])[
        None, None
    ]
    mask = mask.expand(s, 1, nq, t).contiguous()
    with torch.inference_mode():
        visible = cuda_ops.visible_keys(mask, t, q.device)
        paged = cuda_ops.attention(q, cache[:, :hkv], cache[:, hkv:], 0.25, None, visible, (blocks, 4))
        gathered = cuda_ops.attention(q, kv[:, :hkv], kv[:, hkv:], 0.25, None, visible)
    assert torch.equal(paged, gathered)


def test_cuda_without_triton_warns(monkeypatch):
    """Without Triton the CUDA layers are PyTorch's, not batch-invariant: the engine says so."""
    from verispec.engine import builder

    monkeypatch.setattr(cuda_ops, "HAVE_TRITON", False)
    with pytest.warns(UserWarning, match="Triton is not installed.*not batch-invariant"):
        builder.warn_without_triton(torch.device("cuda"))
    monkeypatch.setattr(cuda_ops, "HAVE_TRITON", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        builder.warn_without_triton(torch.device("cuda"))
        builder.warn_without_triton(torch.device("cpu"))
