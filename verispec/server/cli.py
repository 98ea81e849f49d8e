"""`verispec serve`: the server's own flags (the engine's come from EngineArgs.add_cli_args), `--config FILE.yaml`
merging into one EngineArgs plus the server options, and the uvicorn launch.

Precedence: command-line flag > config file > environment (VERISPEC_API_KEY) > default.
Run standalone with `python -m verispec.server.cli MODEL ...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import uvicorn

from verispec.engine.args import EngineArgs
from verispec.engine.builder import run_headless
from verispec.llm import LLM
from verispec.server.app import build_app
from verispec.server.async_engine import on_engine_thread
from verispec.server.connections import fit_limits, guarded_protocol
from verispec.server.shutdown import DrainingServer
from verispec.server.tools import TOOL_PARSERS
from verispec.spec_config import parse_json_config


@dataclass
class ServeConfig:
    """The server's own options; every engine setting is in `engine`."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] | None = None
    max_queue: int = 256
    max_request_body_bytes: int = 4 << 20
    shutdown_timeout: float = 30.0
    # connections (verispec/server/connections.py)
    read_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 512
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    # tool_choice "auto": the model's own tool calls, read by the --tool-call-parser (verispec/server/tools.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # a node other than 0 of a multi-node tensor-parallel engine: run its ranks, serve nothing
    headless: bool = False
    engine: EngineArgs = field(default_factory=EngineArgs)


_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
API_KEY_ENV = "VERISPEC_API_KEY"
# what a --config file may set: every engine setting and every server option, by name
_OPTIONS = {f.name: f for f in (*fields(EngineArgs), *fields(ServeConfig)) if f.name != "engine"}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The engine flags (EngineArgs.add_cli_args) and the server's. Every default is None so that run_server can
    tell which flags were given (they override --config)."""
    EngineArgs.add_cli_args(p, with_defaults=False)
    p.add_argument(
        "--config", default=None, help="YAML file with any of these options (dashes or underscores)"
    )
    p.add_argument(
        "--headless",
        action="store_true",
        default=None,
        help="run this node's tensor-parallel ranks for node 0's engine (--nnodes, --node-rank > 0), no server",
    )
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default 8000")
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env VERISPEC_API_KEY)"
    )
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="name(s) the API accepts (default MODEL)"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="waiting requests allowed beyond the KV slots before answering 503 (default 256)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="larger request bodies are refused with 413 before they are read (default 4 MiB)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        help="on SIGTERM, seconds running requests may take to finish before they are ended (default 30)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="seconds a request's headers may take to arrive, and its body may pause, before the connection is "
        "closed (default 10)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=None,
        help="seconds an idle kept-alive connection stays open (default 5)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at most; one more closes the one idle longest, or gets 503 if none is (default 512)",
    )
    p.add_argument("--uvicorn-log-level", default=None, choices=_LOG_LEVELS)
    p.add_argument("--disable-uvicorn-access-log", action="store_true", default=None)
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        default=None,
        help='allow tool_choice "auto" (the default with tools): the model decides to call tools; needs '
        "--tool-call-parser",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help=f'how the model writes tool calls, read for tool_choice "auto": {", ".join(TOOL_PARSERS)}',
    )


def _check_value(key: str, value: Any, where: str) -> Any:
    """Type-check one option from the config file against its field's type (argparse did it for flags)."""
    if value is None:
        return None
    # the field's first type: "int | None" -> "int"
    kind = str(_OPTIONS[key].type).split(" | ")[0]
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    if kind == "str" and not isinstance(value, str):
        raise ValueError(f"{where}: {key} must be a string, got {value!r}")
    if kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    if kind == "list[str]":
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}: {key} must be a string or a list of strings, got {value!r}")
    if kind.startswith("Mapping"):
        value = parse_json_config(value, f"{where}: {key}")
    return value


def load_config_file(path: str) -> dict[str, Any]:
    """The options a YAML file sets (keys with dashes or underscores), each type-checked. Raises ValueError."""
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
    out = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in _OPTIONS:
            allowed = ", ".join(sorted(_OPTIONS))
            raise ValueError(
                f"--config {path}: unknown option {raw_key!r}; allowed (dashes or underscores): {allowed}"
            )
        out[key] = _check_value(key, value, f"--config {path}")
    return out


def resolve_config(args: argparse.Namespace) -> ServeConfig:
    """Flags over the config file over the environment (VERISPEC_API_KEY) over defaults, as one ServeConfig whose
    `engine` is the EngineArgs the server builds its engine from. Raises ValueError."""
    merged: dict[str, Any] = {}
    # where the API key comes from, for the message if it is blank
    key_source = None
    env_key = os.environ.get(API_KEY_ENV)
    if env_key is not None:
        merged["api_key"], key_source = env_key, f"{API_KEY_ENV} (the environment's --api-key)"
    if getattr(args, "config", None):
        from_file = {k: v for k, v in load_config_file(args.config).items() if v is not None}
        merged.update(from_file)
        key_source = f"api-key in --config {args.config}" if "api_key" in from_file else key_source
    merged.update({k: getattr(args, k) for k in _OPTIONS if getattr(args, k, None) is not None})
    key_source = "--api-key" if getattr(args, "api_key", None) is not None else key_source
    server = {f.name for f in fields(ServeConfig)}
    cfg = ServeConfig(
        engine=EngineArgs.from_mapping(merged), **{k: v for k, v in merged.items() if k in server}
    )
    check_api_key(cfg.api_key, key_source or "--api-key")
    _check_server_options(cfg)
    return cfg


def check_api_key(key: str | None, source: str) -> None:
    """A blank key must not turn authentication off (`--api-key "$KEY"` with KEY unset): ValueError naming its
    source. A key an HTTP header cannot carry as written (surrounding spaces, non-ASCII) is refused too."""
    if key is None:
        return
    if not key.strip():
        raise ValueError(
            f"{source} is empty: give a key, or leave it out to serve without authentication (an unset variable "
            'in --api-key "$KEY" gives an empty key)'
        )
    if key != key.strip() or not (key.isascii() and key.isprintable()):
        raise ValueError(
            f"{source} must be printable ASCII without leading or trailing spaces (what an Authorization header "
            "carries)"
        )


def _check_server_options(cfg: ServeConfig) -> None:
    if not 0 <= cfg.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {cfg.port}")
    if cfg.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {cfg.max_queue}")
    if cfg.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {cfg.max_request_body_bytes}")
    if not cfg.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {cfg.shutdown_timeout}")
    for name in ("read_timeout", "keep_alive_timeout"):
        value = getattr(cfg, name)
        if not 0 < value < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
    if cfg.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {cfg.max_connections}")
    _check_tool_options(cfg)
    if cfg.uvicorn_log_level not in _LOG_LEVELS:
        raise ValueError(
            f"uvicorn-log-level must be one of {', '.join(_LOG_LEVELS)}, got {cfg.uvicorn_log_level!r}"
        )


def _check_tool_options(cfg: ServeConfig) -> None:
    if cfg.tool_call_parser is not None and cfg.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(
            f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {cfg.tool_call_parser!r}"
        )
    if cfg.enable_auto_tool_choice and cfg.tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser (one of "
            f"{', '.join(TOOL_PARSERS)}): how the model's tool calls are read"
        )


def run_server(args: argparse.Namespace) -> int:
    """Load the model and serve until SIGINT/SIGTERM. User errors raise ValueError (the CLI prints one line)."""
    cfg = resolve_config(args)
    level = logging.DEBUG if cfg.uvicorn_log_level in ("debug", "trace") else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    if cfg.headless:
        return run_headless(cfg.engine)

    def load() -> LLM:
        return LLM(**vars(cfg.engine))

    try:
        # the thread that will step the engine (see async_engine.py)
        llm = on_engine_thread(load).result()
    except OSError as e:
        raise ValueError(f"cannot load model {cfg.engine.model!r}: {e}") from None
    names = cfg.served_model_name or [cfg.engine.model]
    app = build_app(
        llm,
        names,
        api_key=cfg.api_key,
        max_queue=cfg.max_queue,
        model_path=cfg.engine.model,
        max_request_body_bytes=cfg.max_request_body_bytes,
        tool_call_parser=cfg.tool_call_parser if cfg.enable_auto_tool_choice else None,
    )
    shown = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"}
    logging.getLogger("verispec.server").info("verispec serve config: %s", shown)
    limits = fit_limits(cfg.read_timeout, cfg.max_connections)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.uvicorn_log_level,
        access_log=not cfg.disable_uvicorn_access_log,
        timeout_graceful_shutdown=10,
        # uvicorn's h11 protocol with a read timeout and a connection limit (verispec/server/connections.py)
        http=guarded_protocol(limits),
        backlog=limits.backlog,
        timeout_keep_alive=cfg.keep_alive_timeout,  # type: ignore[arg-type]
    )
    DrainingServer(config, cfg.shutdown_timeout).run()
    return 0


class _Parser(argparse.ArgumentParser):
    # one line, exit code 2 (argparse's usage block is noise here)
    def error(self, message: str):
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
