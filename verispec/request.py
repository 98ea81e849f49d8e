"""Per-request state held by the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from verispec.outputs import Logprob
from verispec.sampling_params import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    # tokens whose K/V are in the cache (all of prompt + output except the newest)
    num_computed: int = 0
    # after a preemption: the tokens to recompute before decoding again (all but the newest)
    recompute_to: int = 0
    # the prefix cache's chained hashes of the request's full blocks of tokens, in order (block_pool.block_hash)
    block_hashes: list[bytes] = field(default_factory=list)
    # how many of its blocks are registered in the prefix cache
    num_cached_blocks: int = 0
    # extra key of the prefix cache: requests with different salts never share cached blocks
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    # keys the uniform of each output position's categorical sample (logits.position_uniforms)
    sample_key: int = 0
    detokenizer: object | None = None
    # params' token constraints in the forms a step applies, made once when the request is added
    # bad_words as token sequences
    bad_words_token_ids: list[list[int]] | None = None
    # [V] bool: the tokens allowed_token_ids leaves out
    disallowed: torch.Tensor | None = None
    # [n] int64 token ids of logit_bias
    logit_bias_ids: torch.Tensor | None = None
    # [n] float32 their biases
    logit_bias_values: torch.Tensor | None = None
    # structured outputs: the request's grammar matcher (sample/grammar.GrammarState), at its committed output
    grammar: object | None = None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    # filled chunk by chunk during prefill
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # (draft depth, tokens drafted, accepted) per verify step, kept with per_request_spec_decode_metrics:
    # the request's SpecDecodeMetrics
    spec_steps: list[tuple[int, int, int]] = field(default_factory=list)
    # decode steps the request has been scored in (its commit rate: `tokens_per_step`)
    decode_steps: int = 0
    kv_transfer_params: dict | None = (
        # set by a proposer when the request finishes (extract_hidden_states)
        None
    )
    # False when disabled for this request (e.g. disable_by_batch_size)
    speculate: bool = True
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_from(self, start: int) -> list[int]:
        """(prompt + output)[start:] without copying the whole context (hot path)."""
        p = self.num_prompt
        if start >= p:
            return self.output_token_ids[start - p :]
        return self.prompt_token_ids[start:] + self.output_token_ids

    def tail(self, n: int) -> list[int]:
        return self.tokens_from(max(0, self.num_tokens - n))

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def tokens_per_step(self, prior_steps: int = 4) -> float:
        """Tokens the request commits per decode step so far (accepted drafts + 1), starting from prior_steps steps
        of one token each."""
        decoded = max(0, len(self.output_token_ids) - 1)
        return (decoded + prior_steps) / (self.decode_steps + prior_steps)

    @property
    def prefill_end(self) -> int:
        """Positions a prefill computes: the prompt, or after a preemption every token but the newest."""
        return max(self.num_prompt, self.recompute_to)

    @property
    def in_prefill(self) -> bool:
        """True while prompt tokens (or a preempted request's tokens) are still waiting for their K/V."""
        return self.num_computed < self.prefill_end

    @property
    def resuming(self) -> bool:
        """A preempted request recomputing its tokens: its prefill samples nothing."""
        return self.recompute_to >= self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
