"""build_engine: from EngineArgs to a running LLMEngine (device, weights, speculative config, KV cache plan,
model runner, proposer). The one place that assembles an engine; `LLM`, the CLI and the server all call it."""

from __future__ import annotations

import os

import torch

from verispec.engine.args import EngineArgs
from verispec.engine.engine import EngineOptions, LLMEngine
from verispec.engine.kv_cache import KVCache, plan_cache
from verispec.engine.model_runner import ModelRunner
from verispec.loader.checkpoint import load_checkpoint
from verispec.sample.metadata import VerifyRule
from verispec.spec import (
    DraftContext,
    build_proposer,
    check_kv_transfer,
    draft_kv_share,
    resolve_speculative_config,
)
from verispec.spec_config import parse_json_config


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device={device!r} is not supported; allowed: auto, cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available")
    return torch.device(device)


def default_kv_budget(device: torch.device) -> int:
    """Bytes the KV cache may take when kv_cache_memory_bytes is not given: half the free GPU memory, or 30% of the
    free RAM up to 4 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return int(min(avail * 0.3, 4 << 30))


def build_engine(args: EngineArgs) -> LLMEngine:
    """Load the model and everything speculation needs; ValueError naming the setting for a bad one."""
    device = pick_device(args.device)
    ckpt = load_checkpoint(
        args.model,
        device,
        args.dtype,
        args.tokenizer,
        args.skip_tokenizer_init,
        keep_quantized=args.keep_quantized,
        activation_dtype=args.activation_dtype,
    )
    cfg = ckpt.config
    spec = resolve_speculative_config(
        args.speculative_config, args.max_model_len or cfg.max_position_embeddings, ckpt.hf_config
    )
    kv_transfer = args.kv_transfer_config
    if isinstance(kv_transfer, str):
        kv_transfer = parse_json_config(kv_transfer, "kv_transfer_config")
    check_kv_transfer(spec, kv_transfer)
    lookahead = spec.num_lookahead_slots if spec else 0
    # a drafter with its own KV cache (a draft model) takes its share of the budget
    budget = int((args.kv_cache_memory_bytes or default_kv_budget(device)) * (1 - draft_kv_share(spec)))
    plan = plan_cache(cfg, args.max_num_seqs, args.max_model_len, budget, lookahead=lookahead)
    dtype = ckpt.model.embed_tokens.weight.dtype
    t_alloc = plan.max_model_len + lookahead + 1
    cache = KVCache(cfg, plan.num_slots, t_alloc, device, dtype)
    runner = ModelRunner(ckpt.model, cache, device)
    proposer = None
    if spec is not None:
        ctx = DraftContext(ckpt, plan.num_slots, t_alloc, device, dtype, args.seed, kv_transfer)
        proposer = build_proposer(spec, ctx)
    opts = EngineOptions(
        max_model_len=plan.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        verify=VerifyRule.from_config(spec),
        disable_by_batch_size=spec.disable_by_batch_size if spec else None,
        spec_token_budget=args.spec_token_budget or (32 if device.type == "cpu" else 2048),
        draft_max_model_len=spec.max_model_len if spec else None,
    )
    engine = LLMEngine(runner, ckpt.tokenizer, opts, proposer, ckpt.eos_token_ids, args.seed)
    engine.checkpoint, engine.speculative_config = ckpt, spec
    return engine
