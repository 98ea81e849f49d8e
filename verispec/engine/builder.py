"""build_engine: from EngineArgs to a running LLMEngine (device, weights, speculative config, KV cache plan,
model runner, proposer). The one place that assembles an engine; `LLM`, the CLI and the server all call it."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch

from verispec.distributed.cpus import bind_process, cpulist, rank_cores
from verispec.distributed.group import TPGroup, init_group
from verispec.engine.args import EngineArgs
from verispec.engine.engine import LLMEngine
from verispec.engine.options import EngineOptions
from verispec.kernels import cuda_ops
from verispec.kernels.build import build_digest, kernel_isa
from verispec.loader.checkpoint import load_checkpoint
from verispec.planner.goodput import DraftPlanner
from verispec.planner.step_cost import batch_profile_slots, load_or_profile, model_fingerprint, profile_points
from verispec.proposers.factory import (
    DraftContext,
    build_proposer,
    check_kv_transfer,
    draft_kv_share,
    draft_pages_with_target,
    resolve_speculative_config,
)
from verispec.runner.kv_cache import KVCache, kv_cache_torch_dtype, plan_cache
from verispec.runner.model_runner import ModelRunner
from verispec.runner.tp import STOP, MirroredKVCache, TPModelRunner
from verispec.runner.tp_worker import (
    RankSpec,
    Workers,
    agree_loaded,
    check_threads,
    free_init_method,
    launch,
    send_plan,
)
from verispec.sample.metadata import VerifyRule

logger = logging.getLogger(__name__)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device={device!r} is not supported; allowed: auto, cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available")
    return torch.device(device)


def warn_without_triton(device: torch.device) -> None:
    """On CUDA the batch-invariant ops need Triton; without it the layers fall back to PyTorch's kernels."""
    if device.type == "cuda" and not cuda_ops.HAVE_TRITON:
        warnings.warn(
            "verispec: Triton is not installed, so on CUDA the model runs PyTorch's kernels, which are not "
            "batch-invariant: speculative greedy output may differ from plain decoding's at near ties "
            "(pip install triton)",
            stacklevel=3,
        )


def default_kv_budget(device: torch.device) -> int:
    """Bytes the KV cache may take when kv_cache_memory_bytes is not given: half the free GPU memory, or 30% of the
    available RAM up to 4 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    return int(min(available_memory() * 0.3, 4 << 30))


def available_memory(meminfo: str | None = None) -> int:
    """RAM a new allocation can take without swapping: Linux's MemAvailable (free pages plus the page cache the
    kernel can drop, so the budget does not change with what happens to be cached), else the free pages."""
    try:
        text = meminfo if meminfo is not None else Path("/proc/meminfo").read_text()
        kib = next(int(line.split()[1]) for line in text.splitlines() if line.startswith("MemAvailable:"))
        return kib << 10
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def build_engine(args: EngineArgs) -> LLMEngine:
    """Load the model and everything speculation needs; ValueError naming the setting for a bad one."""
    device = pick_device(args.device)
    warn_without_triton(device)
    if args.threads is not None:
        # process-wide: the kernels read torch's thread count on every call
        torch.set_num_threads(args.threads)
    group, workers = start_tensor_parallel(args, device)
    try:
        ckpt = load_checkpoint(
            args.model,
            device,
            args.dtype,
            args.tokenizer,
            args.skip_tokenizer_init,
            keep_quantized=args.keep_quantized,
            activation_dtype=args.activation_dtype,
            tp=group,
        )
    except BaseException:
        if group is not None:
            stop_tensor_parallel(group, workers, loaded=False)
        raise
    if group is not None and not agree_loaded(group, True):
        message = workers.failures()
        stop_tensor_parallel(group, workers, loaded=True)
        raise ValueError(f"tensor_parallel_size={group.size}: a rank could not load {args.model}: {message}")
    try:
        return assemble(args, device, ckpt, group, workers)
    except BaseException:
        if group is not None:
            stop_tensor_parallel(group, workers, loaded=True)
        raise


def assemble(args: EngineArgs, device: torch.device, ckpt, group: TPGroup | None, workers) -> LLMEngine:
    """The engine around a loaded target: speculative config, KV cache plan, runner, proposer, planner."""
    cfg = ckpt.config
    check_draft_parallel(args)
    spec = resolve_speculative_config(
        args.speculative_config,
        args.max_model_len or cfg.max_position_embeddings,
        ckpt.hf_config,
        args.model,
        args.tensor_parallel_size,
    )
    kv_transfer = args.kv_transfer_config
    check_kv_transfer(spec, kv_transfer)
    lookahead = spec.num_lookahead_slots if spec else 0
    # a drafter with its own KV cache (a draft model) takes its share of the budget
    share = draft_kv_share(spec, cfg)
    budget = int((args.kv_cache_memory_bytes or default_kv_budget(device)) * (1 - share))
    # the model's dtype (drafts load in it), and the one K and V are stored in
    dtype = ckpt.model.embed_tokens.weight.dtype
    kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, dtype, args.activation_dtype)
    plan = plan_cache(
        cfg,
        args.max_num_seqs,
        args.max_model_len,
        budget,
        lookahead=lookahead,
        dtype_bytes=kv_dtype.itemsize,
        block_size=args.block_size,
        full_length_slots=share > 0 and not draft_pages_with_target(spec),
    )
    t_alloc = plan.max_model_len + lookahead + 1
    # this rank's KV heads (all of them without tensor parallelism)
    local = ckpt.model.cfg
    if group is None:
        cache = KVCache(local, plan.num_slots, t_alloc, device, kv_dtype, plan.num_blocks, args.block_size)
        runner = ModelRunner(ckpt.model, cache, device)
    else:
        cache = MirroredKVCache(
            local, plan.num_slots, t_alloc, device, kv_dtype, plan.num_blocks, args.block_size
        )
        runner = TPModelRunner(ckpt.model, cache, device, group, workers)
        send_plan(group, cache)
    proposer = None
    if spec is not None:
        ctx = DraftContext(
            ckpt, plan.num_slots, t_alloc, device, dtype, args.seed, kv_transfer, cache, kv_dtype
        )
        proposer = build_proposer(spec, ctx)
    opts = EngineOptions(
        max_model_len=plan.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        verify=VerifyRule.from_config(spec),
        disable_by_batch_size=spec.disable_by_batch_size if spec else None,
        spec_token_budget=args.spec_token_budget or (32 if device.type == "cpu" else 2048),
        draft_max_model_len=spec.max_model_len if spec else None,
        spec_metrics=args.per_request_spec_decode_metrics,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    if spec is not None:
        opts.spec_schedule = spec.num_speculative_tokens_per_batch_size
    planner = None
    if spec is not None and spec.enable_adaptive_verification:
        # an explicit spec_token_budget still bounds a step; otherwise the cost model does
        max_rows = args.spec_token_budget or args.max_num_batched_tokens
        planner = build_planner(args, ckpt, runner, spec, proposer, max_rows)
    engine = LLMEngine(runner, ckpt.tokenizer, opts, proposer, ckpt.eos_token_ids, args.seed, planner)
    engine.checkpoint, engine.speculative_config = ckpt, spec
    return engine


def start_tensor_parallel(args: EngineArgs, device: torch.device) -> tuple[TPGroup | None, Workers | None]:
    """With tensor_parallel_size > 1: the other ranks' processes started and the group joined as rank 0 (this
    process's threads shared out among the ranks); (None, None) otherwise."""
    size = args.tensor_parallel_size
    if size == 1:
        return None, None
    if device.type != "cpu":
        raise ValueError(
            f"tensor_parallel_size={size} runs on the CPU in this build; device={args.device!r} is {device} here: "
            "use device='cpu'"
        )
    if args.node_rank != 0:
        raise ValueError(
            f"node_rank={args.node_rank} runs ranks for node 0's engine: start it with `verispec serve --headless`"
        )
    specs = rank_specs(args)
    placed = (
        " | ".join(f"rank {s.rank}: {cpulist(s.cpus)} x{s.threads}" for s in specs)
        if specs[0].cpus
        else "not bound"
    )
    logger.info("tensor parallelism: %d ranks on this machine, cores and threads %s", len(specs), placed)
    before = bind_process(list(specs[0].cpus)) if specs[0].cpus else None
    torch.set_num_threads(specs[0].threads)
    workers = launch(specs[1:])
    workers.rank0_cores = before
    method = specs[0].init_method
    try:
        return init_group(0, size, method, nodes=args.nnodes), workers
    except ValueError as e:
        message = workers.failures()
        workers.join(1.0)
        raise ValueError(f"{e}; workers: {message}") from None


def rank_specs(args: EngineArgs) -> list[RankSpec]:
    """The ranks this node runs (node n: tensor_parallel_size / nnodes of them from n times that), each bound to its
    cores (one NUMA node each where there are enough, `rank_cores`) with a thread per core, or `threads` shared out;
    ValueError naming the setting when there are more ranks than cores."""
    size, nodes = args.tensor_parallel_size, args.nnodes
    local = size // nodes
    threads = check_threads(local, args.threads)
    cores = rank_cores(local) or [[] for _ in range(local)]
    method = args.distributed_init_method or free_init_method()
    common = (str(args.model), "cpu", args.dtype, args.keep_quantized, args.activation_dtype)
    first = args.node_rank * local
    return [
        RankSpec(*common, first + i, size, method, min(threads, len(c)) if c else threads, tuple(c), nodes)
        for i, c in enumerate(cores)
    ]


def run_headless(args: EngineArgs) -> int:
    """`verispec serve --headless` on node_rank > 0: this node's ranks, until node 0's engine stops them; -> 0 if
    every rank ended cleanly."""
    if args.nnodes == 1 or args.node_rank == 0:
        raise ValueError(
            "--headless runs the ranks of a node other than 0: give --nnodes > 1 and --node-rank > 0"
        )
    workers = launch(rank_specs(args))
    workers.join(None)
    return max(abs(p.returncode or 0) for p in workers.procs)


def stop_tensor_parallel(group: TPGroup, workers: Workers, loaded: bool) -> None:
    """Start-up failed: tell the workers (waiting for the load's outcome, or for the cache plan or a step after
    it), close, wait for them."""
    try:
        if loaded:
            group.broadcast(torch.tensor([STOP]))
        else:
            agree_loaded(group, False)
    finally:
        group.close()
        workers.join(5.0)


def check_draft_parallel(args: EngineArgs) -> None:
    """Drafts run on rank 0, unsharded: a draft_tensor_parallel_size above 1 is refused, not ignored."""
    spec = args.speculative_config
    draft_tp = spec.get("draft_tensor_parallel_size") if isinstance(spec, dict) else None
    if args.tensor_parallel_size > 1 and draft_tp not in (None, 1):
        raise ValueError(
            f"speculative_config.draft_tensor_parallel_size={draft_tp!r}: drafts run unsharded on rank 0 in this "
            "build; use 1 (or leave it out)"
        )


# the most sequences the step-cost profile's batch step runs (each behind its own copy of a 256-token context)
_BATCH_PROFILE_SEQS = 16


def build_planner(args: EngineArgs, ckpt, runner: ModelRunner, spec, proposer, max_rows: int) -> DraftPlanner:
    """The goodput planner with this model's step-cost profile (cached per model / device / kernel build)."""

    k = spec.num_lookahead_slots
    top = min(max_rows, args.max_num_seqs * (k + 1))
    try:
        isa = kernel_isa()
    except ValueError:
        isa = None
    key = (
        model_fingerprint(ckpt.source),
        str(runner.device),
        # the kernels' build, not only their instruction set: new kernels price rows differently
        None if isa is None else (isa, build_digest(isa)),
        args.activation_dtype,
        args.dtype,
        args.keep_quantized,
    )
    # a batch step over up to 16 sequences prices what an ended request saves a closed batch
    batch_slots = batch_profile_slots(runner.cache, min(args.max_num_seqs, _BATCH_PROFILE_SEQS))
    cost, _ = load_or_profile(runner, 0, profile_points(k, top, args.max_num_seqs), key, batch_slots)
    # a drafter without a forward of its own drafts one-hot tokens cheaply: its unverified drafts are judged for free
    # against the tokens committed, where the verification rule accepts a draft as often as the target samples it
    runs_forward = proposer.needs.runs_forward
    shadow = not runs_forward and VerifyRule.from_config(spec).next_token_judges
    return DraftPlanner(spec.num_speculative_tokens, cost, runs_forward, max_rows, shadow_drafts=shadow)
