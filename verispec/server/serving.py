"""What both OpenAI endpoints share: the served model's names and limits, the context-length rules, the fan-out
of prompts x n into engine requests, and their submission."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.engine.fanout import EngineRequest, fan_out
from verispec.outputs import RequestOutput
from verispec.sample.constraints import bad_words_token_ids
from verispec.server import protocol as P
from verispec.server.async_engine import AsyncEngine, EngineError, QueueFullError, RequestGroup
from verispec.server.errors import APIError, bad_request
from verispec.server.streaming import Prompts
from verispec.tokenizer import Tokenizer

# No token of any tokenizer we know spans more bytes than this: a text longer than max_model_len times this many
# UTF-8 bytes cannot fit the context, whatever it tokenizes to, and is refused without being tokenized.
MAX_BYTES_PER_TOKEN = 256


@dataclass
class ServingContext:
    engine: AsyncEngine
    tokenizer: Tokenizer | None
    names: list[str]
    max_model_len: int
    # most engine requests (prompts x n) one HTTP request may ask for
    max_children: int
    # --per-request-spec-decode-metrics (the engine's setting): none | summary | detailed
    spec_metrics: str = "none"
    # the parser of tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser); None: "auto" is a 400
    tool_call_parser: str | None = None

    @property
    def model_name(self) -> str:
        return self.names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def response_metrics(self, finals: list[RequestOutput | None]) -> dict | None:
        """The response's `metrics` object, vLLM's {"speculative_decoding": {...}}, or None when not asked for
        (--per-request-spec-decode-metrics none). As in vLLM it describes one generation stream: null for a
        response of several sequences (n > 1, or a batch of prompts)."""
        if self.spec_metrics == "none":
            return None
        spec = finals[0].spec_decode_metrics if len(finals) == 1 and finals[0] is not None else None
        return {"speculative_decoding": spec.to_json() if spec is not None else None}

    def check_text_length(self, nbytes: int, param: str) -> None:
        """400 for a text that cannot fit the context (checked before tokenizing it, which would take long)."""
        limit = self.max_model_len * MAX_BYTES_PER_TOKEN
        if nbytes > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your {param} is "
                f"{nbytes} bytes long, more than the {limit} bytes that many tokens can hold (at most "
                f"{MAX_BYTES_PER_TOKEN} bytes per token). Please reduce the length of the input.",
                param,
            )

    def resolve_max_tokens(self, requested: int | None, prompt_len: int) -> int | None:
        """max_tokens, or what is left of the context if not given; 400 (vLLM's message) if it cannot fit."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input messages.",
                "prompt",
            )
        room = limit - prompt_len
        if requested is None:
            return room
        # < 1 is rejected by SamplingParams with its own message
        if requested >= 1 and requested > room:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{requested + prompt_len} tokens ({prompt_len} in the messages, {requested} in the completion). "
                "Please reduce the length of the messages or completion.",
                "max_tokens",
            )
        return requested

    def engine_requests(
        self,
        base: str,
        prompts: Prompts,
        req: P._SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> list[EngineRequest]:
        """Every prompt's n engine requests (ids f"{base}-{i}" per prompt when several, then fanout's), with the
        bad words tokenized once for all of them and the output constraint compiled for each. Run it off the event
        loop (a request may list 1,024 bad words) and off the engine thread (a schema may take long to compile)."""
        out: list[EngineRequest] = []
        for i, (text, ids) in enumerate(prompts):
            try:
                sp = req.sampling_params(
                    self.resolve_max_tokens(max_tokens, len(ids)), logprobs, prompt_logprobs
                )
            except ValueError as e:
                raise bad_request(e) from None
            rid = base if len(prompts) == 1 else f"{base}-{i}"
            out += fan_out(rid, text, ids, sp)
        if out and out[0].params.bad_words and self.tokenizer is not None:
            # here, not on the engine thread, which would stall every running request meanwhile
            words = bad_words_token_ids(out[0].params.bad_words, self.tokenizer)
            for r in out:
                r.bad_words_token_ids = words
        for r in out:
            r.cache_salt = req.cache_salt
        if len(out) > self.max_children:
            raise APIError(
                400,
                f"The request asks for {len(out)} sequences (prompts x n); at most {self.max_children} are "
                "allowed.",
                "n",
            )
        self._compile_grammars(req, out)
        return out

    def _compile_grammars(self, req: P._SamplingFields, out: list[EngineRequest]) -> None:
        """Each engine request's own grammar matcher (compiled once, then copied from the engine's cache): here,
        not on the engine thread, which would stall every running request meanwhile. A constraint that does not
        compile is a 400 naming the request field it came from."""
        for r in out:
            if r.params.structured_outputs is None:
                continue
            try:
                r.grammar = self.engine.engine.grammar_for(r.params)
            except ValueError as e:
                raise bad_request(req.constraint_error(e)) from None

    async def submit(self, reqs: list[EngineRequest]) -> RequestGroup:
        """Add the requests atomically; the engine validates each prompt (one rejected: none runs)."""
        try:
            return await self.engine.submit(reqs)
        except QueueFullError as e:
            raise APIError(503, str(e)) from None
        except ValueError as e:
            raise bad_request(e) from None
        except EngineError as e:
            raise APIError(e.status, str(e)) from None
