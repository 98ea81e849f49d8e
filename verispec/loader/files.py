"""Reading the small JSON files of a checkpoint folder (config.json, tokenizer_config.json, ...)."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(path: Path) -> dict:
    """A JSON object from `path`; ValueError naming the file if it is missing, not JSON or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
