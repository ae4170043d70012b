"""Importing an optional compiled extension of thinkahead.models (setup.py builds them as optional)."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_extension(name: str, requirement: str) -> tuple[ModuleType | None, str | None]:
    """(module, None) for `thinkahead.models.<name>` when it imports and its `cpu_supported()` is true,
    else (None, why it cannot run: not built, or this CPU lacks `requirement`)."""
    try:
        module = importlib.import_module(f"thinkahead.models.{name}")
    except ImportError as exc:
        return None, f"the extension thinkahead.models.{name} is not built ({exc})"
    if not module.cpu_supported():
        return None, f"this CPU lacks {requirement}"
    return module, None
