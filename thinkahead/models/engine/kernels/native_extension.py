"""Importing an optional compiled extension of the engine's kernels (setup.py builds them as optional) on
first use: each kernel's module holds one `LazyExtension`."""

from __future__ import annotations

import importlib
from types import ModuleType

PACKAGE = __name__.rsplit(".", 1)[0]  # the kernels' package: setup.py builds the extensions into it


class LazyExtension:
    """An optional extension of the engine's kernels imported on first use: `load()` gives the module, or
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
        """`thinkahead.models.engine.kernels.<name>` when it imports and its `cpu_supported()` is true, else None (and
        `error`: not built, or this CPU lacks `requirement`). Tried once."""
        if not self._tried:
            self._tried = True
            try:
                module = importlib.import_module(f"{PACKAGE}.{self.name}")
            except ImportError as exc:
                self.error = f"the extension {PACKAGE}.{self.name} is not built ({exc})"
            else:
                if module.cpu_supported():
                    self.module = module
                else:
                    self.error = f"this CPU lacks {self.requirement}"
        return self.module

    def require(self, what: str, advice: str = "") -> ModuleType:
        """The module, or a ValueError saying that `what` cannot run here, why, then `advice`."""
        module = self.load()
        if module is None:
            raise ValueError(f"{what} cannot run here: {self.error}{advice}")
        return module
