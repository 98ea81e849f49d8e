"""Offline API in vLLM's shape: LLM(...).generate / .chat / .get_metrics."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verispec.engine.engine import EngineOptions, LLMEngine
from verispec.engine.fanout import fan_out, merge
from verispec.engine.kv_cache import KVCache, plan_cache
from verispec.engine.model_runner import ModelRunner
from verispec.loader.checkpoint import DEFAULT_MODEL, load_checkpoint
from verispec.metrics import Metric
from verispec.outputs import RequestOutput
from verispec.sampling_params import SamplingParams
from verispec.spec import SUPPORTED_METHODS, DraftContext, build_proposer, check_supported
from verispec.spec_config import MTP_MODEL_TYPES, SpeculativeConfig, parse_json_config

PromptType = str | Mapping[str, Any]


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device={device!r} is not supported; allowed: auto, cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available")
    return torch.device(device)


def default_kv_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return int(min(avail * 0.3, 4 << 30))


def _draft_hf_config(spec: Mapping[str, Any]) -> dict | None:
    """Read the draft's config (method inference, n_predict) without loading its weights where possible."""
    model = spec.get("model") if isinstance(spec, Mapping) else None
    if not isinstance(model, str) or model in ("ngram", "[ngram]"):
        return None
    from pathlib import Path

    from verispec.loader.checkpoint import ALIASES, resolve_model_path
    from verispec.loader.hf import read_hf_config

    if model not in ALIASES and not Path(model).expanduser().exists():
        raise ValueError(f"speculative_config.model {model!r} not found: pass an HF folder or a .gguf file")
    path = resolve_model_path(model)
    if path.is_dir():
        return read_hf_config(path)
    return None


def resolve_speculative_config(
    speculative_config: Mapping[str, Any] | str | None,
    target_max_model_len: int,
    target_hf_config: dict | None = None,
) -> SpeculativeConfig | None:
    """The user's speculative_config (a dict or a JSON string) validated and resolved as vLLM does, and checked
    against what this build supports; ValueError naming the key otherwise."""
    if speculative_config is None:
        return None
    if isinstance(speculative_config, str):
        speculative_config = parse_json_config(speculative_config)
    if not isinstance(speculative_config, Mapping):
        raise ValueError("speculative_config must be a dict (or a JSON object string)")
    # no model: an MTP method drafts with the target's own layers (its config gives n_predict), as in vLLM
    mtp = speculative_config.get("method") in ("mtp", *MTP_MODEL_TYPES)
    mtp_config = target_hf_config if mtp else None
    spec = SpeculativeConfig.from_dict(
        speculative_config,
        target_max_model_len=target_max_model_len,
        draft_hf_config=_draft_hf_config(speculative_config)
        if speculative_config.get("model")
        else mtp_config,
        supported_methods=SUPPORTED_METHODS,
    )
    check_supported(spec)
    return spec


class LLM:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        seed: int = 0,
        device: str = "auto",
        skip_tokenizer_init: bool = False,
        speculative_config: Mapping[str, Any] | str | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_num_batched_tokens: int = 1024,
        spec_token_budget: int | None = None,
        keep_quantized: bool = True,
        kv_transfer_config: Mapping[str, Any] | str | None = None,
    ):
        """keep_quantized: GGUF Q4_0 / Q4_1 / Q8_0 weights stay in their blocks on the CPU (native kernels, same
        float32 weight values, 4-6x fewer bytes per token); False dequantizes every weight to float32."""
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        if spec_token_budget is not None and (
            not isinstance(spec_token_budget, int) or spec_token_budget < 1
        ):
            raise ValueError(f"spec_token_budget must be a positive integer, got {spec_token_budget!r}")
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be a positive integer, got {max_num_batched_tokens!r}"
            )
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        self.device = pick_device(device)
        self._loaded_on, self._warned_thread = threading.get_ident(), False  # see _run
        self.ckpt = load_checkpoint(
            model, self.device, dtype, tokenizer, skip_tokenizer_init, keep_quantized=keep_quantized
        )
        cfg = self.ckpt.config
        spec = resolve_speculative_config(
            speculative_config, max_model_len or cfg.max_position_embeddings, self.ckpt.hf_config
        )
        self.speculative_config = spec
        if isinstance(kv_transfer_config, str):
            kv_transfer_config = parse_json_config(kv_transfer_config, "kv_transfer_config")
        if kv_transfer_config is not None and (spec is None or spec.method != "extract_hidden_states"):
            raise ValueError(
                "kv_transfer_config is only supported with speculative_config method 'extract_hidden_states' "
                "(the hidden-states connector)"
            )
        k = spec.num_speculative_tokens if spec else 0
        lookahead = max(k, len(spec.token_tree)) if spec else 0  # a token tree scores all its nodes at once
        budget = kv_cache_memory_bytes or default_kv_budget(self.device)
        if spec is not None and spec.method == "draft_model":
            budget //= 2
        plan = plan_cache(cfg, max_num_seqs, max_model_len, budget, lookahead=lookahead)
        dt = self.ckpt.model.embed_tokens.weight.dtype
        t_alloc = plan.max_model_len + lookahead + 1
        cache = KVCache(cfg, plan.num_slots, t_alloc, self.device, dt)
        runner = ModelRunner(self.ckpt.model, cache, self.device)
        proposer = None
        if spec is not None:
            proposer = build_proposer(
                spec,
                DraftContext(self.ckpt, plan.num_slots, t_alloc, self.device, dt, seed, kv_transfer_config),
            )
        opts = EngineOptions(
            max_model_len=plan.max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            num_speculative_tokens=k,
            rejection_sample_method=spec.rejection_sample_method if spec else "strict",
            synthetic_acceptance_rate=spec.synthetic_acceptance_rate if spec else None,
            block_verify=bool(spec and spec.enable_block_verify),
            entropy_verify=(spec.posterior_threshold, spec.posterior_alpha)
            if spec and spec.enable_entropy_verify
            else None,
            disable_by_batch_size=spec.disable_by_batch_size if spec else None,
            spec_token_budget=spec_token_budget or (32 if self.device.type == "cpu" else 2048),
            draft_max_model_len=spec.max_model_len if spec else None,
        )
        self.tokenizer = self.ckpt.tokenizer
        self.engine = LLMEngine(runner, self.tokenizer, opts, proposer, self.ckpt.eos_token_ids, seed)
        self.max_model_len = plan.max_model_len
        self._counter = 0

    # ------------------------------------------------------------------ prompts
    def _to_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
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
                return self._to_ids(prompt["prompt"])
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
        encoded = [self._to_ids(p) for p in prompts]  # validate everything before adding anything
        queued: list[str] = []
        try:
            ids = [self._add(text, toks, sp, queued) for (text, toks), sp in zip(encoded, params)]
        except Exception:  # a rejected prompt: the ones queued before it do not run (or linger) either
            for rid in queued:
                self.engine.abort_request(rid)
                self.engine.release(rid)
            raise
        return self._run(ids, use_tqdm)

    def _add(self, text: str | None, toks: list[int], sp: SamplingParams, queued: list[str]) -> list[str]:
        """Queue the prompt's n requests; their ids -> also appended to `queued` as each is added."""
        base = str(self._counter)
        self._counter += 1
        children = []
        for r in fan_out(base, text, toks, sp):
            self.engine.add_request(r.request_id, r.prompt, r.prompt_token_ids, r.params)
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
    ) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer (skip_tokenizer_init=True was given)")
        if not messages:
            raise ValueError("messages must be a non-empty list")
        convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for conv in convs:
            for m in conv:
                if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                    raise ValueError("each message must be a dict with 'role' and 'content'")
            text = self.tokenizer.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt)
            prompts.append(
                {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
            )
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> list[Metric]:
        return self.engine.counters.to_metrics(len(self.engine.running), len(self.engine.waiting))

    def get_tokenizer(self):
        return self.tokenizer
