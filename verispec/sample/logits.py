"""Batched logits processing and sampling.

Every row N is one (request, position) pair. Plain decoding has one row per request; speculative
verification has K+1 rows per request. Both paths go through exactly the same functions, so the
target distribution at every position is computed by identical math, which is what makes
speculation lossless.

Pipeline (vLLM semantics, v0 order):
    raw logits -> apply_penalties -> [greedy rows: argmax]
               -> logits_to_probs (temperature, top-k, top-p, min-p, renormalise) -> sample
Logprobs are computed from the RAW logits (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from verispec.kernels import ops
from verispec.sample.verify import categorical
from verispec.sampling_params import SamplingParams


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors, plus host flags to skip disabled features.

    Greedy rows get temperature 1 and disabled top-k/top-p/min-p (they use argmax anyway);
    penalties still apply to them. top_k is clamped to [1, V]; disabled == V.
    """

    # [N] float32
    temperature: torch.Tensor
    # [N] int64, V when disabled
    top_k: torch.Tensor
    # [N] float32
    top_p: torch.Tensor
    # [N] float32
    min_p: torch.Tensor
    # [N] float32
    presence_penalty: torch.Tensor
    # [N] float32
    frequency_penalty: torch.Tensor
    # [N] float32
    repetition_penalty: torch.Tensor
    # [N] bool
    is_greedy: torch.Tensor
    all_greedy: bool
    any_penalties: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str, vocab_size: int
    ) -> SamplingTensors:
        """One row per entry of ``params`` (repeat entries, or use ``repeat_interleave``, for multi-row)."""
        greedy = [p.is_greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [
            vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)
        ]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        repetition = [p.repetition_penalty for p in params]

        # [6, N]: one tensor for the float fields (a sampled step builds these every step)
        floats = torch.tensor(
            [temperature, top_p, min_p, presence, frequency, repetition], dtype=torch.float32, device=device
        )
        return cls(
            temperature=floats[0],
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=floats[1],
            min_p=floats[2],
            presence_penalty=floats[3],
            frequency_penalty=floats[4],
            repetition_penalty=floats[5],
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_penalties=any(p.has_penalties for p in params),
            any_top_k=any(k < vocab_size for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(m > 0.0 for m in min_p),
        )

    def repeat_interleave(
        self, counts: Sequence[int] | torch.Tensor, total: int | None = None
    ) -> SamplingTensors:
        """Expand per-request rows to per-row: request i's row repeated counts[i] times.

        E.g. counts = num_drafts + 1 for verification. Pass ``counts`` as a list (or give ``total``)
        to avoid a host sync. Host flags are kept (conservative if a request gets 0 rows).
        """
        if not isinstance(counts, torch.Tensor):
            total = sum(counts) if total is None else total
            counts = torch.tensor(list(counts), dtype=torch.int64)
        counts = counts.to(self.temperature.device, non_blocking=True)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = torch.repeat_interleave(v, counts, dim=0, output_size=total)
            out[f.name] = v
        return SamplingTensors(**out)


# [N, V] float32
def apply_penalties(
    # [N, V]
    logits: torch.Tensor,
    # [N, V] bool: token appears in the prompt
    prompt_mask: torch.Tensor,
    # [N, V] int: occurrences in the output so far
    output_counts: torch.Tensor,
    st: SamplingTensors,
) -> torch.Tensor:
    """vLLM penalties: repetition on prompt|output tokens (divide positive, multiply negative logits),
    frequency subtracts freq * count, presence subtracts presence * (count > 0)."""
    logits = logits.float()
    # [N, V]
    output_mask = output_counts > 0
    # [N, 1]
    rep = st.repetition_penalty[:, None]
    # [N, V]
    seen = prompt_mask | output_mask
    # [N, V]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - st.frequency_penalty[:, None] * output_counts.to(torch.float32)
    logits = logits - st.presence_penalty[:, None] * output_mask.to(torch.float32)
    return logits


# [B, K+1, V]
def draft_aware_counts(
    # [B, V] int
    output_counts: torch.Tensor,
    # [B, K] int, -1 padded
    draft_token_ids: torch.Tensor,
) -> torch.Tensor:
    """Output counts seen at each verification position: position j counts drafts[:j] as output.

    So the penalties at verify position j equal those plain decoding would apply after accepting
    drafts[:j]. Uses scatter_add (same result as one_hot + cumsum, without a [B, K, V] temporary).
    """
    B, K = draft_token_ids.shape
    # [B, K]
    valid = draft_token_ids >= 0
    # [B, K]
    ids = draft_token_ids.clamp_min(0)
    # [K+1]
    pos = torch.arange(K + 1, device=ids.device)
    # [K+1, K]: draft i < position j
    before = pos[:, None] > torch.arange(K, device=ids.device)[None, :]
    # [B, K+1, K]
    add = (before[None] & valid[:, None, :]).to(output_counts.dtype)
    # [B, K+1, V]
    counts = output_counts[:, None, :].expand(B, K + 1, output_counts.shape[-1]).clone()
    return counts.scatter_add_(2, ids[:, None, :].expand(B, K + 1, K), add)


# [N, V], dropped tokens set to -inf
def apply_top_k_top_p(
    # [N, V] float32
    logits: torch.Tensor,
    # [N] int64 in [1, V] or None
    top_k: torch.Tensor | None,
    # [N] float32 or None
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM top-k / top-p with one shared ascending sort. Top-k keeps ties with the k-th value;
    top-p keeps the smallest set with cumulative prob >= top_p (the top token always kept)."""
    if top_k is None and top_p is None:
        return logits
    # [N, V]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        # [N, 1]
        kth = logits_sort.gather(1, (logits.shape[-1] - top_k)[:, None])
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    if top_p is not None:
        # [N, V] ascending
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        # [N, V]
        drop = cum <= (1.0 - top_p)[:, None]
        drop[:, -1] = False
        logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)


# [N, V] unnormalised
def apply_min_p(
    # [N, V] float32
    probs: torch.Tensor,
    # [N] float32
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Zero tokens with prob < min_p * max prob."""
    # [N, 1]
    top = probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < min_p[:, None] * top, 0.0)


def logits_to_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits [N, V] -> probs [N, V] float32: temperature, top-k, top-p, min-p, renormalise.

    Greedy rows use temperature 1 with no truncation (their probs are the plain softmax)."""
    logits = logits.float()
    if not st.all_greedy:
        # [N, V]
        logits = logits / st.temperature[:, None]
    logits = apply_top_k_top_p(logits, st.top_k if st.any_top_k else None, st.top_p if st.any_top_p else None)
    # [N, V]
    probs = logits.softmax(dim=-1)
    if st.any_min_p:
        probs = apply_min_p(probs, st.min_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: probs [N, V], u [N] in [0, 1) -> tokens [N] int64 (verify.categorical).

    P(token i) = probs[i] / sum(probs): probs need not be normalised (e.g. a rejection residual)."""
    return categorical(probs, u)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> argmax tokens [N] int64 (the fused CPU kernel where it applies: same answer)."""
    out = ops.argmax(logits) if logits.is_cpu else None
    return out if out is not None else logits.argmax(dim=-1)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """Per-request generator for a seeded request (create once per request, keep across steps)."""
    return torch.Generator(device=device).manual_seed(seed)


# splitmix64's increment and finaliser multipliers, as signed int64 (torch's integer type)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_M64 = (1 << 64) - 1


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _splitmix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser over int64 lanes (wrapping arithmetic)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _signed64(x: int) -> int:
    """x mod 2^64 as a signed int64."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def _splitmix_int(z: int) -> int:
    """_splitmix on one Python integer, taken mod 2^64: the same bits as the int64 lanes (as an unsigned value)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def sample_key(seed: int) -> int:
    """A request's sampling key from its seed (splitmix64 of the seed): nearby seeds give unrelated streams."""
    return _signed64(_splitmix_int((seed + 1) * _GOLDEN))


# a CPU step's few uniforms are hashed in Python: a dozen torch ops on a handful of values cost more than the hash
_HOST_UNIFORMS = 64


def position_uniform(key: int, pos: int) -> float:
    """position_uniforms for one (key, position) in Python integers: the same bits, so the same float."""
    return (_splitmix_int(key + pos * _GOLDEN) >> 40) * (1.0 / (1 << 24))


# [B, n] float32 U[0, 1)
def position_uniforms(keys: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
    """The uniform of each request's output positions ([B, n] int64): a hash (splitmix64) of the request's key and
    the position, in 24 bits, like torch.rand's float32. A position's categorical sample reads the same uniform
    whichever step scores it, so strict verification emits exactly the tokens plain decoding samples: speculation
    does not change a seeded request's sampled text."""
    small = positions.dim() == 2 and positions.shape[0] == len(keys) and positions.numel() <= _HOST_UNIFORMS
    # (on a GPU the positions would have to come to the host first)
    if small and positions.device.type == "cpu":
        # k / 2^24 with k < 2^24: exact in float32
        rows = [[position_uniform(k, p) for p in row] for k, row in zip(keys, positions.tolist())]
        return torch.tensor(rows, dtype=torch.float32, device=positions.device).view(positions.shape)
    # [B, n] int64, wrapping arithmetic
    z = torch.tensor(keys, dtype=torch.int64, device=positions.device)[:, None] + positions.long() * _GOLDEN
    return _shr(_splitmix(z), 40).to(torch.float32) * (1.0 / (1 << 24))


def _rows_by_request(
    n_rows_per_request: Sequence[int],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None,
    draw: Callable[[int, torch.Generator | None], torch.Tensor],
) -> torch.Tensor:
    """draw(n, generator) per request: seeded requests from their own generator, all unseeded rows from one
    batched draw of the default generator. A seeded request's draws are thus independent of the batch."""
    if all(g is None for g in generators):
        return draw(sum(n_rows_per_request), default_generator)
    shared = draw(sum(n for n, g in zip(n_rows_per_request, generators) if g is None), default_generator)
    chunks, off = [], 0
    # loop over requests, not tokens
    for n, g in zip(n_rows_per_request, generators):
        if g is None:
            chunks.append(shared[off : off + n])
            off += n
        else:
            chunks.append(draw(n, g))
    return torch.cat(chunks, dim=0)


# [N] float32 U[0, 1), N = sum(n_rows_per_request)
def draw_row_uniforms(
    n_rows_per_request: Sequence[int],
    generators: Sequence[torch.Generator | None],
    device: torch.device | str,
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One uniform per row, for `sample` (seeding as in `_rows_by_request`)."""
    return _rows_by_request(
        n_rows_per_request,
        generators,
        default_generator,
        lambda n, g: torch.rand(n, device=device, generator=g),
    )


# [N, V] float32 ~ Exp(1), N = sum(n_rows_per_request)
def draw_noise(
    n_rows_per_request: Sequence[int],
    generators: Sequence[torch.Generator | None],
    vocab_size: int,
    device: torch.device | str,
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Exp(1) noise over the vocabulary, for drawing several tokens without replacement (`tree_verify.
    sample_children`; seeding as in `_rows_by_request`)."""
    return _rows_by_request(
        n_rows_per_request,
        generators,
        default_generator,
        lambda n, g: torch.empty(n, vocab_size, device=device).exponential_(generator=g),
    )


class Logprobs(NamedTuple):
    # [N] float32
    token_logprob: torch.Tensor
    # [N, num_top] int64
    top_ids: torch.Tensor
    # [N, num_top] float32
    top_logprobs: torch.Tensor
    # [N] int64, 1-based (1 + #tokens with strictly higher logprob)
    token_rank: torch.Tensor


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> Logprobs:
    """Logprobs of ``token_ids`` [N] and the top ``num_top`` from log_softmax of RAW logits [N, V]."""
    # [N, V]
    logprobs = logits.float().log_softmax(dim=-1)
    # [N]
    token_logprob = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    # [N]
    token_rank = (logprobs > token_logprob[:, None]).sum(dim=-1) + 1
    # [N, num_top]
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return Logprobs(token_logprob, top_ids, top_logprobs, token_rank)


# [N] int64
def greedy_or_sample(
    # [N] int64
    argmax: torch.Tensor,
    # [N, V] or None when every row is greedy
    probs: torch.Tensor | None,
    # [N] U[0, 1), with probs
    u: torch.Tensor | None,
    # [N] bool, with probs
    is_greedy: torch.Tensor | None,
) -> torch.Tensor:
    """Each row's token: its argmax where the row is greedy, else a sample of its probs. The one place that
    mixes greedy and random rows of plain sampling."""
    if probs is None:
        return argmax
    return torch.where(is_greedy, argmax, sample(probs, u))


def position_uniforms_of(reqs: list, offsets: torch.Tensor) -> torch.Tensor:
    """[B, n] the uniform of each request's output position len(output) + offsets ([n] or [B, n] int64): the one
    plain decoding reads at that position (logits.position_uniforms)."""
    first = torch.tensor([len(r.output_token_ids) for r in reqs], device=offsets.device)
    return position_uniforms([r.sample_key for r in reqs], first[:, None] + offsets)
