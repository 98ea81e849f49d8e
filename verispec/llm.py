"""Offline API in vLLM's shape: LLM(...).generate / .chat / .get_metrics."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from verispec.engine.args import EngineArgs
from verispec.engine.builder import build_engine
from verispec.engine.data_parallel import DataParallelEngine
from verispec.engine.fanout import fan_out, merge
from verispec.loader.checkpoint import DEFAULT_MODEL
from verispec.metrics import Metric
from verispec.outputs import RequestOutput
from verispec.sampling_params import SamplingParams

PromptType = str | Mapping[str, Any]


class LLM:
    """The offline engine: `LLM(model, speculative_config={...}).generate(prompts, sampling_params)`.

    Every keyword is an EngineArgs field (engine/args.py), which says what each one means."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any):
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"LLM() got unknown argument(s) {unknown}; allowed: {', '.join(sorted(known))}")
        args = EngineArgs(model=model, **kwargs)
        # see _run: generating on another thread than this one is slow on CPUs
        self._loaded_on, self._warned_thread = threading.get_ident(), False
        self.engine = DataParallelEngine(args) if args.data_parallel_size > 1 else build_engine(args)
        self.ckpt = self.engine.checkpoint
        self.device = self.engine.device
        self.speculative_config = self.engine.speculative_config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.opts.max_model_len
        self._counter = 0

    # ------------------------------------------------------------------ prompts
    def _to_ids(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """-> (text, token ids, cache salt)."""
        text, ids = self._ids_of(prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("cache_salt must be a non-empty string")
        return text, ids, salt

    def _ids_of(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]} instead")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, Sequence) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self._ids_of(prompt["prompt"])
        raise ValueError("each prompt must be a str or a dict with 'prompt_token_ids' (or 'prompt')")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            list(sampling_params)
            if isinstance(sampling_params, Sequence)
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        # validate everything before adding anything
        encoded = [self._to_ids(p) for p in prompts]
        queued: list[str] = []
        try:
            ids = [self._add(text, toks, salt, sp, queued) for (text, toks, salt), sp in zip(encoded, params)]
        # a rejected prompt: the ones queued before it do not run (or linger) either
        except Exception:
            for rid in queued:
                self.engine.abort_request(rid)
                self.engine.release(rid)
            raise
        return self._run(ids, use_tqdm)

    def _add(
        self, text: str | None, toks: list[int], salt: str | None, sp: SamplingParams, queued: list[str]
    ) -> list[str]:
        """Queue the prompt's n requests; their ids -> also appended to `queued` as each is added."""
        base = str(self._counter)
        self._counter += 1
        children = []
        for r in fan_out(base, text, toks, sp):
            self.engine.add_request(r.request_id, r.prompt, r.prompt_token_ids, r.params, cache_salt=salt)
            children.append(r.request_id)
            queued.append(r.request_id)
        return children

    def _run(self, groups: list[list[str]], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        if self.device.type == "cpu" and threading.get_ident() != self._loaded_on and not self._warned_thread:
            self._warned_thread = True
            warnings.warn(
                "verispec: generating on another thread than the one that loaded the model; the CPU kernels' OpenMP "
                "runtime then keeps two thread pools and can run several times slower. Load and "
                "generate on the same thread.",
                stacklevel=3,
            )

        bar = tqdm(total=len(groups), desc="Processed prompts", disable=not use_tqdm or len(groups) < 2)
        pending = {rid for g in groups for rid in g}
        done: dict[str, RequestOutput] = {}
        # every request was added before the first step: none joins the running batch
        self.engine.closed = True
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        self.engine.release(out.request_id)
                        bar.update(
                            sum(1 for g in groups if g[-1] == out.request_id and all(x in done for x in g))
                        )
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
                self.engine.release(rid)
            raise
        finally:
            self.engine.closed = False
            bar.close()
        if self.engine.spec_log is not None:
            self.engine.spec_log.maybe_log(force=True)
        return [merge([done[rid] for rid in g]) for g in groups]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation rendered with the model's chat template (tools: OpenAI-style function
        definitions the template renders, as vLLM's `tools`), then generated."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer (skip_tokenizer_init=True was given)")
        if not messages:
            raise ValueError("messages must be a non-empty list")
        convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for conv in convs:
            for m in conv:
                if (
                    not isinstance(m, Mapping)
                    or "role" not in m
                    or ("content" not in m and "tool_calls" not in m)
                ):
                    raise ValueError(
                        "each message must be a dict with 'role' and 'content' (or 'tool_calls')"
                    )
            text = self.tokenizer.apply_chat_template(
                list(conv), add_generation_prompt=add_generation_prompt, tools=tools
            )
            prompts.append(
                {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
            )
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks, data-parallel replicas); the LLM cannot
        generate after."""
        self.engine.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's LLM.reset_prefix_cache); False while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        return self.engine.counters.to_metrics(len(self.engine.running), len(self.engine.waiting))

    def get_tokenizer(self):
        return self.tokenizer
