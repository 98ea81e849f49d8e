"""Committing emitted tokens to a request, one token at a time, with every stop rule plain decoding has.

A step may emit several tokens (accepted drafts + one); the request ends exactly where plain decoding would:
EOS, stop_token_ids, stop strings (neither leaks into the text unless include_stop_str_in_output), max_tokens,
max_model_len.
"""

from __future__ import annotations

from verispec.outputs import Logprob
from verispec.request import Request


def logprob_entry(r: Request, lp, row: int, token: int, n: int) -> dict[int, Logprob]:
    """Row `row` of a sampler Logprobs as vLLM's dict: `token` first, then the top n (decoded if a tokenizer)."""
    entry = {token: Logprob(float(lp.token_logprob[row]), int(lp.token_rank[row]))}
    for i in range(n):
        tid = int(lp.top_ids[row, i])
        if tid not in entry:
            entry[tid] = Logprob(float(lp.top_logprobs[row, i]), i + 1)
    dec = getattr(r.detokenizer, "tokenizer", None)
    if dec is not None:
        for tid, v in entry.items():
            v.decoded_token = dec.decode([tid], skip_special_tokens=False)
    return entry


def _stop_string(r: Request, prev_len: int) -> bool:
    """Look for a stop string in the newly extended text; truncate at it. Returns True if stopped."""
    stops = r.params.stop
    if not stops:
        return False
    longest = max(len(s) for s in stops)
    start = max(0, prev_len - longest + 1)
    best = None
    for s in stops:
        i = r.text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return False
    i, s = best
    r.text = r.text[: i + len(s)] if r.params.include_stop_str_in_output else r.text[:i]
    r.finish_reason, r.stop_reason = "stop", s
    return True


def commit_tokens(r: Request, tokens: list[int], max_model_len: int, step=None, b: int = 0) -> int:
    """Append tokens until a stop rule fires. Returns how many were appended."""
    p = r.params
    added = 0
    for j, t in enumerate(tokens):
        r.output_token_ids.append(t)
        added += 1
        if r.logprobs is not None and step is not None and step.logprobs is not None:
            row = b * step.row_stride + j
            r.logprobs.append(logprob_entry(r, step.logprobs, row, t, r.params.logprobs or 0))
            r.cumulative_logprob += float(step.logprobs.token_logprob[row])
        n_out = len(r.output_token_ids)
        is_eos = not p.ignore_eos and t in r.eos_token_ids
        stop_token = n_out >= p.min_tokens and (is_eos or t in p.all_stop_token_ids)
        # as vLLM: the text of a token that stops the request is kept only with include_stop_str_in_output
        render = p.include_stop_str_in_output if stop_token else not is_eos
        if r.detokenizer is not None and render:
            prev = len(r.text)
            r.detokenizer.add_tokens([t])
            r.text = r.detokenizer.text
            if n_out >= p.min_tokens and not stop_token and _stop_string(r, prev):
                return added
        if stop_token:
            r.finish_reason, r.stop_reason = "stop", None if is_eos else t
            return added
        if p.max_tokens is not None and n_out >= p.max_tokens:
            r.finish_reason = "length"
            return added
        if r.num_tokens >= max_model_len:
            r.finish_reason = "length"
            return added
    return added


def length_left(r: Request, max_model_len: int) -> int:
    """The tokens request r may still commit before max_tokens or max_model_len ends it."""
    left = max_model_len - r.num_tokens
    if r.params.max_tokens is not None:
        left = min(left, r.params.max_tokens - len(r.output_token_ids))
    return left


def may_end_early(r: Request) -> bool:
    """Whether something other than its length may end request r: EOS (not ignored), stop tokens or strings."""
    p = r.params
    return bool((r.eos_token_ids and not p.ignore_eos) or p.stop or p.all_stop_token_ids)
