"""`custom_class`: a team's own proposer class, named by its import path in `speculative_config.model` (vLLM's
plugin method), loaded and checked against the `Proposer` protocol of proposers/base.py before the engine uses it.

The class is called as `cls(config, context)`: the resolved `SpeculativeConfig` and the `DraftContext` of
proposers/base.py (the target checkpoint, cache slots, device, dtype, seed). The instance must carry `needs` (a
`ProposerNeeds`) and `add_request`, `remove_request`, `propose`, plus whatever its needs make the engine call
(`backlog` with `runs_forward`, `observe_hidden` with target states, `observe_states` with `observes_states`). Every
mismatch is a ValueError naming the key, before the first request.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from verispec.proposers.base import DraftContext, Proposer, ProposerNeeds
from verispec.spec_config import SpeculativeConfig, custom_proposer_path

KEY = "speculative_config.model"
# the methods the engine calls on every proposer
_ALWAYS = ("add_request", "remove_request", "propose")


def load_proposer_class(path: str) -> type:
    """The class at `path` ("package.module.ClassName" or "package.module:ClassName"), or a ValueError naming the
    key: a path that is not one, a module that does not import, a missing name, something that is not a class or
    lacks the protocol's methods."""
    parsed = custom_proposer_path(path)
    if parsed is None:
        raise ValueError(f"{KEY} {path!r} must be an import path 'package.module.ClassName'")
    module_path, name = parsed
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ValueError(f"{KEY} {path!r}: cannot import module {module_path!r} ({e})") from e
    cls = getattr(module, name, None)
    if cls is None:
        raise ValueError(f"{KEY} {path!r}: module {module_path!r} has no attribute {name!r}")
    if not inspect.isclass(cls):
        raise ValueError(f"{KEY} {path!r} is not a proposer class (it is of type {type(cls).__name__})")
    missing = [m for m in _ALWAYS if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(
            f"{KEY} {path!r} is not a Proposer (verispec/proposers/base.py): no {', '.join(missing)}"
        )
    return cls


def build_custom_proposer(path: str, config: SpeculativeConfig, context: DraftContext) -> Proposer:
    """Load the class at `path`, build it as `cls(config, context)` and check the instance."""
    cls = load_proposer_class(path)
    try:
        inspect.signature(cls).bind(config, context)
    except TypeError:
        raise ValueError(
            f"{KEY} {path!r}: a proposer class is built as cls(config, context) (the SpeculativeConfig and the "
            f"DraftContext), but its signature is {inspect.signature(cls)}"
        ) from None
    return check_proposer(cls(config, context), path)


def check_proposer(proposer: Any, path: str) -> Proposer:
    """The instance against the protocol: `needs` is a ProposerNeeds, and every method its needs make the engine
    call exists."""
    needs = getattr(proposer, "needs", None)
    if not isinstance(needs, ProposerNeeds):
        raise ValueError(
            f"{KEY} {path!r} is not a Proposer: `needs` must be a ProposerNeeds (verispec/proposers/base.py), "
            f"got {needs!r}"
        )
    wanted = {
        "backlog": needs.runs_forward,
        "observe_hidden": needs.target_hidden != "none",
        "observe_states": needs.observes_states,
    }
    missing = [m for m, used in wanted.items() if used and not callable(getattr(proposer, m, None))]
    if missing:
        raise ValueError(
            f"{KEY} {path!r}: its needs ({needs}) make the engine call {', '.join(missing)}, which it lacks"
        )
    return proposer
