"""The engine's settings as one plain dataclass, with its command-line flags defined once.

`LLM(...)`, `verispec generate`, `verispec bench` and `verispec serve` all build an `EngineArgs` and hand it to
`build_engine` (engine/builder.py). Field names are vLLM's where vLLM has the setting.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from verispec.loader.checkpoint import ACTIVATION_DTYPES, DEFAULT_MODEL
from verispec.outputs import SPEC_METRICS_LEVELS
from verispec.runner.kv_cache import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, KV_CACHE_DTYPES, check_kv_cache_dtype
from verispec.spec_config import parse_json_config


@dataclass
class EngineArgs:
    # model
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    skip_tokenizer_init: bool = False
    # GGUF Q4_0 / Q4_1 / Q8_0 weights stay in their blocks on the CPU (native kernels, same float32 weight values,
    # 4-6x fewer bytes per token); False dequantizes every weight to float32
    keep_quantized: bool = True
    # "float32" (transformers' numerics) or "int8": kept GGUF weights multiply int8-quantized activations
    # (llama.cpp's numerics, faster; see loader/checkpoint.py)
    activation_dtype: str = "float32"
    seed: int = 0
    # CPU threads of the kernels and PyTorch (None: PyTorch's default, one per core it may run on)
    threads: int | None = None
    # device: auto | cpu | cuda[:N]
    device: str = "auto"
    # tensor parallelism: ranks (one process each, started by the engine) and their rendezvous (None: a free port
    # on 127.0.0.1; tcp://host:port or env:// as torch.distributed takes them)
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    # machines the ranks run on (tensor_parallel_size / nnodes ranks each) and this one's index: node 0 runs the
    # engine (rank 0); the others run `verispec serve --headless` (their ranks only)
    nnodes: int = 1
    node_rank: int = 0
    # data parallelism: whole engine replicas (one process each) behind one front end, requests routed by cached
    # prefix and load (engine/data_parallel.py)
    data_parallel_size: int = 1
    # cache: KV slots (concurrent sequences) and the memory they may take (None: a share of free memory)
    max_num_seqs: int = 16
    kv_cache_memory_bytes: int | None = None
    # tokens per KV block, and automatic prefix caching (on by default, as in vLLM's v1 engine)
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    # what K and V are stored in (vLLM's kv_cache_dtype): auto | float32 | float16 | bfloat16; auto = the model's
    # dtype (float32 on the CPU), float16 under int8 activations (runner/kv_cache.py: kv_cache_torch_dtype)
    kv_cache_dtype: str = "auto"
    # scheduler: prompt tokens per step, and most tokens one decode step may score (None: 32 on a CPU)
    max_num_batched_tokens: int = 1024
    spec_token_budget: int | None = None
    # speculative decoding (vLLM's keys), and extract_hidden_states' connector
    speculative_config: Mapping[str, Any] | str | None = None
    kv_transfer_config: Mapping[str, Any] | str | None = None
    # each finished output's speculation (SpecDecodeMetrics): none (nothing collected) | summary | detailed
    per_request_spec_decode_metrics: str = "none"

    def __post_init__(self) -> None:
        # JSON strings (--speculative-config) become dicts here, so that every command parses them in one place
        for name in ("speculative_config", "kv_transfer_config"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, parse_json_config(value, name))
        self.validate()

    def validate(self) -> None:
        """ValueError naming the setting for a value the engine cannot use."""
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.threads is not None and (not _is_int(self.threads) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        self._check_parallel()
        if self.spec_token_budget is not None and (
            not _is_int(self.spec_token_budget) or self.spec_token_budget < 1
        ):
            raise ValueError(f"spec_token_budget must be a positive integer, got {self.spec_token_budget!r}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            allowed = ", ".join(ACTIVATION_DTYPES)
            raise ValueError(
                f"activation_dtype={self.activation_dtype!r} is not supported; allowed: {allowed}"
            )
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not _is_int(self.block_size) or self.block_size not in BLOCK_SIZES:
            allowed = ", ".join(map(str, BLOCK_SIZES))
            raise ValueError(f"block_size must be one of {allowed}, got {self.block_size!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}"
            )
        self._check_spec_metrics()

    def _check_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if not _is_int(tp) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        method = self.distributed_init_method
        if method is not None and not (
            isinstance(method, str) and (method.startswith("tcp://") or method == "env://")
        ):
            raise ValueError(f"distributed_init_method must be tcp://host:port or env://, got {method!r}")
        dp = self.data_parallel_size
        if not _is_int(dp) or dp < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {dp!r}")
        nodes, node = self.nnodes, self.node_rank
        if not _is_int(nodes) or nodes < 1 or tp % nodes:
            raise ValueError(
                f"nnodes must be a positive integer dividing tensor_parallel_size={tp}, got {nodes!r}"
            )
        if not _is_int(node) or not 0 <= node < nodes:
            raise ValueError(f"node_rank must be an integer in 0..{nodes - 1} (nnodes={nodes}), got {node!r}")
        if nodes > 1 and method is None:
            raise ValueError(
                f"nnodes={nodes} needs distributed_init_method=tcp://<node 0's address>:<port>, the same on every node"
            )
        if tp > 1 and self.device not in ("auto", "cpu"):
            raise ValueError(
                f"tensor_parallel_size={tp} runs on the CPU in this build (gloo and shared memory); "
                f"device={self.device!r} is not supported with it: use device='cpu'"
            )

    def _check_spec_metrics(self) -> None:
        level = self.per_request_spec_decode_metrics
        if level not in SPEC_METRICS_LEVELS:
            allowed = ", ".join(SPEC_METRICS_LEVELS)
            raise ValueError(
                f"per_request_spec_decode_metrics={level!r} is not supported; allowed: {allowed}"
            )
        # as vLLM: there is nothing to report without a speculative method
        if level != "none" and not self.speculative_config:
            raise ValueError(
                f"per_request_spec_decode_metrics={level!r} requires speculative decoding to be enabled (via "
                "--speculative-config)"
            )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, with_defaults: bool = True) -> None:
        """The engine flags (vLLM's spelling). with_defaults=False leaves every default None so that a caller
        merging a config file can tell which flags were given."""

        def default(name: str) -> Any:
            return _DEFAULTS[name] if with_defaults else None

        parser.add_argument(
            "model",
            nargs="?",
            default=default("model"),
            help=f"HF folder, .gguf file or alias (default {DEFAULT_MODEL})",
        )
        parser.add_argument(
            "--tokenizer", default=None, help="folder with the tokenizer.json to use (default: the model's)"
        )
        parser.add_argument(
            "--skip-tokenizer-init",
            action="store_true",
            default=default("skip_tokenizer_init"),
            help="load no tokenizer (prompts must be token ids)",
        )
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument(
            "--max-num-seqs",
            type=int,
            default=default("max_num_seqs"),
            help="concurrent sequences (KV slots), default 16",
        )
        parser.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=default("max_num_batched_tokens"),
            help="prefill chunk budget, default 1024",
        )
        parser.add_argument("--dtype", default=default("dtype"), help="auto | float32 | float16 | bfloat16")
        parser.add_argument(
            "--kv-cache-dtype",
            default=default("kv_cache_dtype"),
            help=f"what K and V are stored in: {' | '.join(KV_CACHE_DTYPES)}; auto = the model's dtype (float32 on "
            "the CPU), float16 with --activation-dtype int8",
        )
        parser.add_argument(
            "--activation-dtype",
            default=default("activation_dtype"),
            choices=("float32", "int8"),
            help="float32 (default) | int8: llama.cpp's numerics on GGUF weights, faster",
        )
        parser.add_argument(
            "--keep-quantized",
            action=argparse.BooleanOptionalAction,
            default=default("keep_quantized"),
            help="keep GGUF Q4_0 / Q4_1 / Q8_0 weights in their blocks on the CPU (default); "
            "--no-keep-quantized dequantizes them to float32",
        )
        _add_runtime_args(parser, default)
        _add_cache_args(parser, default)
        parser.add_argument(
            "--kv-cache-memory-bytes",
            type=int,
            default=None,
            help="bytes the KV cache may take (default: a share of free memory)",
        )
        parser.add_argument(
            "--spec-token-budget",
            type=int,
            default=None,
            help="most tokens one decode step may score (default 32 on a CPU, 2048 on a GPU)",
        )
        _add_spec_args(parser, default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The flags add_cli_args defined (None: not given, the default stays), then `overrides`."""
        given = {
            f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None
        }
        return cls(**(given | overrides))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> EngineArgs:
        """The engine settings among `values` (a merged config); other keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names and v is not None})


def _add_cache_args(parser: argparse.ArgumentParser, default) -> None:
    """The KV cache's blocks and prefix caching."""
    parser.add_argument(
        "--block-size",
        type=int,
        default=default("block_size"),
        choices=BLOCK_SIZES,
        help=f"tokens per KV cache block, default {DEFAULT_BLOCK_SIZE}",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=default("enable_prefix_caching"),
        help="reuse the KV blocks of prompts' cached prefixes (default); --no-enable-prefix-caching turns it off",
    )


def _add_spec_args(parser: argparse.ArgumentParser, default) -> None:
    """Speculation: its config, extract_hidden_states' connector, per-request metrics."""
    parser.add_argument(
        "--speculative-config",
        "-sc",
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    parser.add_argument(
        "--kv-transfer-config",
        default=None,
        help="JSON for method extract_hidden_states: kv_connector ExampleHiddenStatesConnector, "
        "kv_connector_extra_config.shared_storage_path",
    )
    parser.add_argument(
        "--per-request-spec-decode-metrics",
        default=default("per_request_spec_decode_metrics"),
        choices=SPEC_METRICS_LEVELS,
        help="each finished output's (and response's) speculative-decoding figures: none (default) | summary | "
        "detailed (also per-step arrays)",
    )


def _add_runtime_args(parser: argparse.ArgumentParser, default) -> None:
    """Where the engine runs: device, seed, threads."""
    parser.add_argument("--device", default=default("device"), help="auto | cpu | cuda")
    parser.add_argument("--seed", type=int, default=default("seed"))
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the kernels and PyTorch (default: one per core this process may run on); with "
        "tensor parallelism, shared out among the ranks",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=default("tensor_parallel_size"),
        help="ranks the model is sharded over (one process each; default 1)",
    )
    parser.add_argument(
        "--distributed-init-method",
        default=None,
        help="rendezvous of the tensor-parallel ranks: tcp://host:port or env:// (default: a free local port)",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=default("data_parallel_size"),
        help="engine replicas (one process each) behind one front end, requests routed by cached prefix and load",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=default("nnodes"),
        help="machines the tensor-parallel ranks are spread over (default 1)",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=default("node_rank"),
        help="this machine's index among --nnodes: 0 serves, the others run with --headless",
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_DEFAULTS = {f.name: f.default for f in fields(EngineArgs)}
