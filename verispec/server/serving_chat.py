"""POST /v1/chat/completions: messages rendered with the model's chat template, `n`, logprobs, streaming, tool calls
(verispec/server/tools.py: the tools rendered into the prompt, the output read back as tool_calls)."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request

from verispec.outputs import Logprob, RequestOutput
from verispec.server import protocol as P
from verispec.server.errors import APIError, bad_request
from verispec.server.serving import ServingContext
from verispec.server.streaming import Prompts, collect, sse, sse_response, stream_events, usage
from verispec.server.tools import ToolChoice, ToolError, ToolStream, check_auto, final_message

_lp = P.json_logprob


async def create_chat_completion(ctx: ServingContext, req: P.ChatCompletionRequest, request: Request):
    ctx.check_model(req.model)
    logprobs = _logprobs(req)
    plan = _tool_plan(ctx, req)
    # rendered and tokenized off the event loop: /health and other requests keep being answered meanwhile
    prompts = [await asyncio.to_thread(chat_prompt, ctx, req, plan)]
    rid = P.random_id("chatcmpl")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    group = await ctx.submit(
        await asyncio.to_thread(ctx.engine_requests, rid, prompts, req, max_tokens, logprobs)
    )
    created, name = int(time.time()), req.model or ctx.model_name
    top = req.top_logprobs or 0
    if not req.stream:
        finals = await collect(request, ctx.engine, group)
        resp = _response(rid, created, name, prompts, finals, top if logprobs is not None else None, plan)
        resp.metrics = ctx.response_metrics(finals)
        return resp

    # each choice's text as content and tool call deltas (ToolStream)
    tool_streams = [ToolStream(plan) for _ in group.request_ids]

    def choice(i, text, entries, offset, final):
        content, calls = tool_streams[i].feed(text, final is not None)
        if content is None and calls is None and entries is None and final is None:
            # all held back (a possible tool call)
            return None
        return P.ChatStreamChoice(
            index=i,
            delta=P.DeltaMessage(content=content, tool_calls=calls),
            logprobs=chat_logprobs(entries, top) if entries is not None else None,
            finish_reason=tool_streams[i].finish_reason(final.finish_reason) if final else None,
            stop_reason=final.stop_reason if final else None,
        )

    def chunk(choices, u, metrics=None):
        return P.ChatCompletionChunk(
            id=rid, created=created, model=name, choices=choices, usage=u, metrics=metrics
        )

    async def events():
        # vLLM sends the role first, one chunk per choice
        for i in range(len(group.request_ids)):
            yield sse(
                chunk([P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))], None)
            )
        async for event in stream_events(group, req, prompts, logprobs, choice, chunk, ctx.response_metrics):
            yield event

    return sse_response(request, ctx.engine, group, events())


def _response(
    rid: str,
    created: int,
    name: str,
    prompts: Prompts,
    finals: list[RequestOutput],
    top: int | None,
    plan: ToolChoice,
) -> P.ChatCompletionResponse:
    """The non-streamed response (top: the top_logprobs count, None without logprobs)."""
    outs = [f.outputs[0] for f in finals]
    choices = []
    for i, o in enumerate(outs):
        content, calls, reason = final_message(plan, o.text, o.finish_reason)
        choices.append(
            P.ChatChoice(
                index=i,
                message=P.AssistantMessage(content=content, tool_calls=calls or None),
                finish_reason=reason,
                stop_reason=o.stop_reason,
                logprobs=chat_logprobs(o.logprobs, top) if top is not None else None,
            )
        )
    return P.ChatCompletionResponse(
        id=rid,
        created=created,
        model=name,
        choices=choices,
        usage=usage(prompts, outs),
        prompt_logprobs=P.prompt_logprobs(finals[0].prompt_logprobs),
        kv_transfer_params=finals[0].kv_transfer_params,
    )


def _logprobs(req: P.ChatCompletionRequest) -> int | None:
    try:
        return req.requested_logprobs()
    except ValueError as e:
        raise bad_request(e) from None


def _tool_plan(ctx: ServingContext, req: P.ChatCompletionRequest) -> ToolChoice:
    """The request's validated tools and tool_choice; a 400 naming the field, and vLLM's for "auto" on a server
    without a tool-call parser."""
    try:
        plan = req.tool_plan()
        check_auto(plan, ctx.tool_call_parser)
    except (P.FieldError, ToolError) as e:
        raise APIError(400, str(e), e.field) from None
    return plan


def chat_prompt(ctx: ServingContext, req: P.ChatCompletionRequest, plan: ToolChoice) -> tuple[str, list[int]]:
    """The conversation rendered by the model's chat template (with the tools, as transformers' `tools`, even
    under tool_choice "none", as vLLM), and its token ids."""
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise APIError(400, "chat completions need a tokenizer")
    try:
        messages = [m.template_dict() for m in req.messages]
    except ValueError as e:
        raise bad_request(e) from None
    nbytes = sum(len(m["content"].encode()) for m in messages)
    ctx.check_text_length(nbytes + (len(json.dumps(plan.tools)) if plan.tools else 0), "messages")
    extra = {"tools": plan.tools} if plan.tools else {}
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, **extra
        )
    except ValueError as e:
        raise bad_request(e) from None
    except Exception as e:
        # jinja2's TemplateError from the model's template (e.g. roles must alternate)
        raise APIError(400, f"chat template error: {e}", "messages") from None
    return text, tokenizer.encode(text, add_special_tokens=False)


def chat_logprobs(entries: list[dict[int, Logprob]] | None, top: int) -> P.ChatLogprobs:
    content = []
    for entry in entries or []:
        lp = entry[next(iter(entry))]
        tok = lp.decoded_token or ""
        ranked = sorted(
            (v for v in entry.values() if v.rank is not None and v.rank <= top), key=lambda v: v.rank
        )
        tops = [
            P.TopLogprob(
                token=v.decoded_token or "",
                logprob=_lp(v.logprob),
                bytes=list((v.decoded_token or "").encode()),
            )
            for v in ranked[:top]
        ]
        content.append(
            P.ChatTokenLogprob(
                token=tok, logprob=_lp(lp.logprob), bytes=list(tok.encode()), top_logprobs=tops
            )
        )
    return P.ChatLogprobs(content=content)
