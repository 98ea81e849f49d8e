"""`verispec serve` flags (vLLM's spelling), `--config FILE.yaml` merging, and the uvicorn launch.

Precedence: command-line flag > config file > environment (VERISPEC_API_KEY) > default.
Run standalone with `python -m verispec.server.cli MODEL ...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from verispec.loader.checkpoint import DEFAULT_MODEL


@dataclass
class ServeConfig:
    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    dtype: str = "auto"
    activation_dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    speculative_config: dict | None = None
    kv_transfer_config: dict | None = None
    kv_cache_memory_bytes: int | None = None
    max_queue: int = 256
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False


_INT = {
    "port",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "seed",
    "kv_cache_memory_bytes",
    "max_queue",
}
_STR = {"model", "host", "api_key", "dtype", "activation_dtype", "device", "uvicorn_log_level"}
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every default is None so that run_server can tell which flags were given (they override --config)."""
    p.add_argument(
        "model", nargs="?", default=None, help=f"HF folder, .gguf file or alias (default {DEFAULT_MODEL})"
    )
    p.add_argument(
        "--config", default=None, help="YAML file with any of these options (dashes or underscores)"
    )
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default 8000")
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env VERISPEC_API_KEY)"
    )
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="name(s) the API accepts (default MODEL)"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="concurrent sequences (KV slots), default 16"
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="prefill chunk budget, default 1024"
    )
    p.add_argument("--dtype", default=None, help="auto | float32 | float16 | bfloat16")
    p.add_argument("--activation-dtype", default=None, choices=("float32", "int8"), help="default float32")
    p.add_argument("--device", default=None, help="auto | cpu | cuda")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--speculative-config",
        "-sc",
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    p.add_argument(
        "--kv-transfer-config",
        default=None,
        help="JSON for method extract_hidden_states: kv_connector ExampleHiddenStatesConnector, "
        "kv_connector_extra_config.shared_storage_path",
    )
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="waiting requests allowed beyond the KV slots before answering 503 (default 256)",
    )
    p.add_argument("--uvicorn-log-level", default=None, choices=_LOG_LEVELS)
    p.add_argument("--disable-uvicorn-access-log", action="store_true", default=None)


def _spec_config(value: Any, where: str) -> dict | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a JSON object / mapping, got {type(value).__name__}")
    return dict(value)


def _check_value(key: str, value: Any, where: str) -> Any:
    """Type-check one option from the config file (argparse did it for flags)."""
    if value is None:
        return None
    if key in _INT and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
    if key in _STR and not isinstance(value, str):
        raise ValueError(f"{where}: {key} must be a string, got {value!r}")
    if key == "served_model_name":
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ValueError(
                f"{where}: served_model_name must be a string or a list of strings, got {value!r}"
            )
    if key == "disable_uvicorn_access_log" and not isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    if key in ("speculative_config", "kv_transfer_config"):
        value = _spec_config(value, f"{where}: {key.replace('_', '-')}")
    return value


def load_config_file(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"cannot read --config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"--config {path} must hold a mapping of option: value")
    known = {f.name for f in fields(ServeConfig)}
    out = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in known:
            raise ValueError(f"--config {path}: unknown option {raw_key!r}")
        out[key] = _check_value(key, value, f"--config {path}")
    return out


def resolve_config(args: argparse.Namespace) -> ServeConfig:
    """Merge flags over the config file over the environment over defaults; validate. Raises ValueError."""
    merged: dict[str, Any] = {}
    env_key = os.environ.get("VERISPEC_API_KEY")
    if env_key:
        merged["api_key"] = env_key
    if getattr(args, "config", None):
        merged.update({k: v for k, v in load_config_file(args.config).items() if v is not None})
    for f in fields(ServeConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            if f.name in ("speculative_config", "kv_transfer_config"):
                value = _spec_config(value, "--" + f.name.replace("_", "-"))
            merged[f.name] = value
    cfg = ServeConfig(**merged)
    if not 0 <= cfg.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {cfg.port}")
    if cfg.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {cfg.max_queue}")
    if cfg.max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {cfg.max_num_seqs}")
    if cfg.uvicorn_log_level not in _LOG_LEVELS:
        raise ValueError(
            f"uvicorn-log-level must be one of {', '.join(_LOG_LEVELS)}, got {cfg.uvicorn_log_level!r}"
        )
    return cfg


def run_server(args: argparse.Namespace) -> int:
    """Load the model and serve until SIGINT/SIGTERM. User errors raise ValueError (the CLI prints one line)."""
    cfg = resolve_config(args)
    level = logging.DEBUG if cfg.uvicorn_log_level in ("debug", "trace") else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")

    import uvicorn

    from verispec.llm import LLM
    from verispec.server.app import build_app
    from verispec.server.async_engine import on_engine_thread

    def load() -> LLM:
        return LLM(
            cfg.model,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            seed=cfg.seed,
            device=cfg.device,
            speculative_config=cfg.speculative_config,
            kv_transfer_config=cfg.kv_transfer_config,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            activation_dtype=cfg.activation_dtype,
        )

    try:
        llm = on_engine_thread(load).result()  # the thread that will step the engine (see async_engine.py)
    except OSError as e:
        raise ValueError(f"cannot load model {cfg.model!r}: {e}") from None
    names = cfg.served_model_name or [cfg.model]
    app = build_app(llm, names, api_key=cfg.api_key, max_queue=cfg.max_queue, model_path=cfg.model)
    shown = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"}
    logging.getLogger("verispec.server").info("verispec serve config: %s", shown)
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.uvicorn_log_level,
        access_log=not cfg.disable_uvicorn_access_log,
        timeout_graceful_shutdown=10,
    )
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2 (argparse's usage block is noise here)
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="verispec serve", description="OpenAI-compatible server with speculative decoding")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_server(args)
    except ValueError as e:
        print(f"verispec serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
