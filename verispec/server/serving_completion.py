"""POST /v1/completions: text or token-id prompts (one or a batch), `n`, logprobs, `echo`, streaming."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from verispec.outputs import Logprob, RequestOutput
from verispec.server import protocol as P
from verispec.server.errors import APIError, bad_request
from verispec.server.serving import ServingContext
from verispec.server.streaming import Prompts, collect, sse_response, stream_events, token_text, usage

_lp = P.json_logprob


async def create_completion(ctx: ServingContext, req: P.CompletionRequest, request: Request):
    ctx.check_model(req.model)
    tokenizer = ctx.tokenizer
    if req.echo and (req.stream or tokenizer is None):
        raise APIError(400, "echo is supported without stream and with a tokenizer only", "echo")
    try:
        logprobs = req.requested_logprobs()
    except ValueError as e:
        raise bad_request(e) from None
    # tokenized off the event loop: /health and other requests keep being answered meanwhile
    prompts = await asyncio.to_thread(completion_prompts, req.prompt, tokenizer, ctx)
    rid = P.random_id("cmpl")
    # echo: the prompt leads each choice's text (and its logprobs); max_tokens=0 returns the prompt alone
    echo_only = req.echo and req.max_tokens == 0
    max_tokens = 1 if echo_only else req.max_tokens
    reqs = await asyncio.to_thread(
        ctx.engine_requests, rid, prompts, req, max_tokens, logprobs, logprobs if req.echo else None
    )
    group = await ctx.submit(reqs)
    created, name = int(time.time()), req.model or ctx.model_name
    finals = None if req.stream else await collect(request, ctx.engine, group)
    if finals is not None:
        choices = [_choice(ctx, req, prompts, logprobs, finals, i) for i in range(len(finals))]
        return P.CompletionResponse(
            id=rid,
            created=created,
            model=name,
            choices=choices,
            usage=usage(prompts, [None if echo_only else f.outputs[0] for f in finals]),
            kv_transfer_params=finals[0].kv_transfer_params,
            metrics=ctx.response_metrics(finals),
        )

    def choice(i, text, entries, offset, final):
        lp = completion_logprobs(entries, offset) if entries is not None else None
        return P.CompletionChoice(
            index=i,
            text=text,
            logprobs=lp,
            finish_reason=final.finish_reason if final else None,
            stop_reason=final.stop_reason if final else None,
        )

    def chunk(choices, u, metrics=None):
        return P.CompletionResponse(
            id=rid, created=created, model=name, choices=choices, usage=u, metrics=metrics
        )

    events = stream_events(group, req, prompts, logprobs, choice, chunk, ctx.response_metrics)
    return sse_response(request, ctx.engine, group, events)


def _choice(
    ctx: ServingContext,
    req: P.CompletionRequest,
    prompts: Prompts,
    logprobs: int | None,
    finals: list[RequestOutput],
    i: int,
) -> P.CompletionChoice:
    """Choice i of a non-streamed response (prompt i // n, sample i % n)."""
    f, o = finals[i], finals[i].outputs[0]
    echo_only = req.echo and req.max_tokens == 0
    text, lp = o.text, completion_logprobs(o.logprobs, 0) if logprobs is not None else None
    if req.echo:
        ptext, pids = prompts[i // (len(finals) // len(prompts))]
        text = (ctx.tokenizer.decode(pids) if ptext is None else ptext) + ("" if echo_only else text)
        if logprobs is not None:
            lp = echo_logprobs(pids, f.prompt_logprobs, ctx.tokenizer, [] if echo_only else o.logprobs)
    return P.CompletionChoice(
        index=i,
        text=text,
        finish_reason="length" if echo_only else o.finish_reason,
        stop_reason=None if echo_only else o.stop_reason,
        logprobs=lp,
        prompt_logprobs=P.prompt_logprobs(f.prompt_logprobs) if req.prompt_logprobs is not None else None,
    )


def completion_prompts(prompt, tokenizer, ctx: ServingContext | None = None) -> Prompts:
    """The request's prompt field as (text or None, token ids) per prompt; with ctx, a text that cannot fit the
    context is refused before it is tokenized."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [(None, list(prompt))]
    if ctx is not None and len(prompt) > ctx.max_children:
        # refused before tokenizing thousands of prompts that could never all run
        raise APIError(
            400,
            f"prompt holds {len(prompt)} prompts; at most {ctx.max_children} sequences (prompts x n) are allowed.",
            "prompt",
        )
    out = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise APIError(400, "text prompts need a tokenizer; send token ids instead", "prompt")
            if ctx is not None:
                ctx.check_text_length(len(p.encode()), "prompt")
            out.append((p, tokenizer.encode(p)))
        else:
            out.append((None, list(p)))
    return out


def completion_logprobs(entries: list[dict[int, Logprob]] | None, offset: int) -> P.CompletionLogprobs:
    out = P.CompletionLogprobs()
    for entry in entries or []:
        tid = next(iter(entry))
        tok = token_text(entry)
        out.tokens.append(tok)
        out.token_logprobs.append(_lp(entry[tid].logprob))
        out.top_logprobs.append({(v.decoded_token or ""): _lp(v.logprob) for v in entry.values()})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def echo_logprobs(ids: list[int], prompt_lp, tokenizer, generated) -> P.CompletionLogprobs:
    """Completion logprobs of an echoed prompt (its first token has none, as in vLLM), then of the generated
    tokens; text offsets run on through both."""
    out = P.CompletionLogprobs()
    offset = 0
    for i, tid in enumerate(ids):
        entry = prompt_lp[i] if prompt_lp is not None and i < len(prompt_lp) else None
        if entry is None:
            tok = tokenizer.decode([tid], skip_special_tokens=False)
        else:
            tok = entry[tid].decoded_token or ""
        out.tokens.append(tok)
        out.text_offset.append(offset)
        out.token_logprobs.append(None if entry is None else _lp(entry[tid].logprob))
        tops = None if entry is None else {(v.decoded_token or ""): _lp(v.logprob) for v in entry.values()}
        out.top_logprobs.append(tops)
        offset += len(tok)
    gen = completion_logprobs(generated, offset)
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(out, name).extend(getattr(gen, name))
    return out
