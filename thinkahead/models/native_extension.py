"""Importing an optional compiled extension of thinkahead.models (setup.py builds them as optional):
`import_extension` once, or `LazyExtension` on first use (the kernels' modules hold one each)."""

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


class LazyExtension:
    """An optional extension of thinkahead.models imported on first use: `load()` gives the module, or
    None where it cannot run (then `error` says why)."""

    def __init__(self, name: str, requirement: str) -> None:
        self.name, self.requirement = name, requirement
        self.module: ModuleType | None = None
        self.error: str | None = None
        self._tried = False

    @classmethod
    def unavailable(cls, name: str, error: str) -> LazyExtension:
        """One that never loads (tests of the fallbacks)."""
        ext = cls(name, "")
        ext.error, ext._tried = error, True
        return ext

    def load(self) -> ModuleType | None:
        if not self._tried:
            self.module, self.error = import_extension(self.name, self.requirement)
            self._tried = True
        return self.module
