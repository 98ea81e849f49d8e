"""Draft weights that ship with verispec: a speculative_config without `model` finds them by target and method.

Each folder here holds a draft (config.json in vLLM's format, its weights as model.safetensors or as Q8_0 blocks in
model.gguf) and training.json, the command and the data manifest that made it, so that `{"method": "eagle3", "num_speculative_tokens": 3}` on the embedded model
needs no path.
"""

from __future__ import annotations

from pathlib import Path

from verispec.loader.aliases import ALIASES
from verispec.loader.checkpoint import resolve_model_path

# (target alias, method) -> folder beside this file
SHIPPED = {("smollm2-135m-instruct", "eagle3"): "smollm2-135m-instruct-eagle3"}


def shipped_draft(target: str | None, method: object) -> str | None:
    """The shipped draft folder for `method` on `target` (an alias, or the path it resolves to), if any."""

    for (alias, m), folder in SHIPPED.items():
        if m != method or target is None:
            continue
        same = target == alias
        if not same and alias in ALIASES and Path(target).expanduser().exists():
            try:
                same = Path(target).expanduser().resolve() == resolve_model_path(alias).resolve()
            except ValueError:
                same = False
        path = Path(__file__).parent / folder
        if same and (path / "config.json").exists():
            return str(path)
    return None
