"""Parallel sampling (`n > 1`) as engine requests: one request per sample, and their outputs merged back.

A prompt with `SamplingParams(n=k)` becomes k engine requests with ids f"{request_id}_{j}" and seeds seed + j
(unseeded children stay unseeded); n == 1 keeps the request id and the params as they are. `LLM.generate` and the
server both fan out here, so a seeded request gives the same k samples through either.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from verispec.outputs import RequestOutput, SpecDecodeMetrics
from verispec.sample.grammar import GrammarState
from verispec.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    """One sequence for `LLMEngine.add_request`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    # params.bad_words as token ids, when the front end tokenized them already (constraints.bad_words_token_ids)
    bad_words_token_ids: list[list[int]] | None = None
    # the prefix cache's salt (requests with different salts never share cached blocks)
    cache_salt: str | None = None
    # params.structured_outputs compiled already (LLMEngine.grammar_for), this request's own matcher
    grammar: GrammarState | None = None


def child_params(params: SamplingParams, j: int) -> SamplingParams:
    """The params of sample j: n=1 and seed + j."""
    seed = None if params.seed is None else params.seed + j
    return dataclasses.replace(params, n=1, seed=seed)


def fan_out(
    request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
) -> list[EngineRequest]:
    """The engine requests of one prompt: one per sample."""
    if params.n == 1:
        return [EngineRequest(request_id, prompt, prompt_token_ids, params)]
    return [
        EngineRequest(f"{request_id}_{j}", prompt, prompt_token_ids, child_params(params, j))
        for j in range(params.n)
    ]


def merge(outs: list[RequestOutput]) -> RequestOutput:
    """The finished children of one prompt as one output: completions indexed 0..n-1, draft counts summed."""
    first = outs[0]
    if len(outs) == 1:
        return first
    comps = []
    for j, o in enumerate(outs):
        c = o.outputs[0]
        c.index = j
        comps.append(c)
    rid = first.request_id.rsplit("_", 1)[0]
    return RequestOutput(
        rid,
        first.prompt,
        first.prompt_token_ids,
        comps,
        True,
        sum(o.num_draft_tokens for o in outs),
        sum(o.num_accepted_tokens for o in outs),
        prompt_logprobs=first.prompt_logprobs,
        spec_decode_metrics=combine_spec_metrics(outs),
    )


def combine_spec_metrics(outs: list[RequestOutput]) -> SpecDecodeMetrics | None:
    """The speculation of several outputs as one (None when none of them speculated)."""
    parts = [o.spec_decode_metrics for o in outs if o.spec_decode_metrics is not None]
    return SpecDecodeMetrics.combine(parts) if parts else None
