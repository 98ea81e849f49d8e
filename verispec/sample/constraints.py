"""Per-request token constraints applied to the logits before sampling: allowed_token_ids, bad_words, logit_bias,
min_tokens, and the penalty state (prompt mask and output counts). Every scored position of a request gets them,
verification rows included, so plain and speculative decoding see the same target distribution."""

from __future__ import annotations

import torch

from verispec.kernels import ops
from verispec.request import Request
from verispec.sample.grammar import masks, refused


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


def set_token_constraints(
    r: Request, tokenizer, vocab: int, device, bad_words: list[list[int]] | None = None
) -> None:
    """r.params' bad_words, allowed_token_ids and logit_bias in the forms constrain_tokens applies (once per
    request, not per step). bad_words: the words' token ids when the caller has them already (the server
    tokenizes them off the engine thread)."""
    p = r.params
    if p.bad_words:
        r.bad_words_token_ids = (
            bad_words if bad_words is not None else bad_words_token_ids(p.bad_words, tokenizer)
        )
    if p.allowed_token_ids is not None:
        # [V] True where the token is not allowed
        r.disallowed = torch.ones(vocab, dtype=torch.bool, device=device)
        r.disallowed[torch.tensor(p.allowed_token_ids, device=device)] = False
    if p.logit_bias:
        # [n] ids and their biases
        r.logit_bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=device)
        r.logit_bias_values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=device)


def has_constraints(r: Request) -> bool:
    return (
        bool(r.bad_words_token_ids)
        or r.disallowed is not None
        or r.logit_bias_ids is not None
        or r.grammar is not None
    )


def has_position_constraints(r: Request) -> bool:
    """Whether the request's logits processing depends on the tokens before a position (penalties, bad words,
    min_tokens still pending, logprobs): a token tree cannot be verified in one pass for it."""
    p = r.params
    return (
        p.has_penalties
        or bool(r.bad_words_token_ids)
        or r.grammar is not None
        or p.logprobs is not None
        or p.min_tokens > len(r.output_token_ids)
    )


def constrain_tokens(logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]]) -> None:
    """allowed_token_ids (every other token -inf), bad_words (at verify position j the output so far includes the
    first j drafts), then logit_bias (added), at every scored position of the request, before min_tokens and the
    penalties, as vLLM orders them; a grammar's mask at every position first. logits [B, K+1, V], in place."""
    apply_grammars(logits, reqs, drafts)
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


def apply_grammars(logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]]) -> None:
    """Structured outputs: every token the request's grammar refuses at a verified position is -inf there (the
    drafts, already cut where the grammar refuses them, are the tokens before each position). logits [B, K+1, V]."""
    with_grammar = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not with_grammar:
        return
    b, stride, v = logits.shape
    # [sum(len(d) + 1), W] int32, and the row of logits.view(B * (K+1), V) each scores
    bitmask = masks([reqs[i].grammar for i in with_grammar], [drafts[i] for i in with_grammar])
    rows = [i * stride + j for i in with_grammar for j in range(len(drafts[i]) + 1)]
    if logits.is_contiguous() and ops.apply_bitmask(logits.view(b * stride, v), bitmask, rows):
        return
    # [R, V] bool
    bad = refused(bitmask, v).to(logits.device, non_blocking=True)
    at = 0
    for i in with_grammar:
        n = len(drafts[i]) + 1
        logits[i, :n].masked_fill_(bad[at : at + n], float("-inf"))
        at += n


def suppress_early_stops(logits: torch.Tensor, reqs: list[Request], stride: int) -> None:
    """min_tokens: EOS and stop_token_ids cannot be sampled before min_tokens outputs (unless the request's grammar
    has ended: then EOS is all it admits). logits [B, K+1, V]."""
    for i, r in enumerate(reqs):
        left = r.params.min_tokens - len(r.output_token_ids)
        # a grammar that has ended admits EOS alone: suppressing it would leave nothing to sample
        if left > 0 and r.grammar is not None and r.grammar.matcher.is_stopped():
            continue
        if left > 0:
            ids = list(r.params.all_stop_token_ids | (set() if r.params.ignore_eos else set(r.eos_token_ids)))
            if ids:
                logits[i, : min(left, stride), ids] = float("-inf")


def penalty_state(reqs: list[Request], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_mask [B, V] bool, output_counts [B, V] int64) of each request's committed tokens."""
    prompt_mask = torch.zeros(len(reqs), vocab, dtype=torch.bool, device=device)
    counts = torch.zeros(len(reqs), vocab, dtype=torch.long, device=device)
    for i, r in enumerate(reqs):
        prompt_mask[i, torch.tensor(r.prompt_token_ids, device=device)] = True
        if r.output_token_ids:
            out = torch.tensor(r.output_token_ids, device=device)
            counts[i].index_add_(0, out, torch.ones_like(out))
    return prompt_mask, counts
