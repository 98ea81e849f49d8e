"""Progress bars of the long commands (bench, audit, training, loading a large GGUF): tqdm on stderr, drawn only
where stderr is a terminal and the command was not given `--quiet`.

`--quiet` is a process-wide switch (`set_quiet`) because the model loader sits below every command and takes no
flags of its own.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

_quiet = False


def set_quiet(quiet: bool) -> None:
    """No progress bar anywhere in this process (a command's `--quiet`)."""
    global _quiet
    _quiet = quiet


def enabled() -> bool:
    """Bars are drawn: stderr is a terminal and no `--quiet` was given."""
    return not _quiet and sys.stderr.isatty()


def bar(iterable=None, **kwargs) -> tqdm:
    """A tqdm bar on stderr, disabled unless `enabled()`; kwargs go to tqdm (desc, total, unit, delay, leave)."""
    return tqdm(iterable, disable=not enabled(), file=sys.stderr, dynamic_ncols=True, **kwargs)
