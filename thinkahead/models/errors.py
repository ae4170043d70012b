"""`ThinkaheadError`, defined in the lowest layer that raises library errors, so that every layer above
(models, verifiers, step_spec, orchestrator, workflows, the top) can subclass it without importing
upwards. Import it as `thinkahead.errors.ThinkaheadError`."""

from __future__ import annotations


class ThinkaheadError(Exception):
    """Base class of the exceptions thinkahead raises on purpose."""


class ModelFileError(ThinkaheadError, ValueError):
    """A model file that is damaged or does not hold what its format and metadata say (a truncated GGUF,
    a tensor out of bounds, a NaN scale): one line naming the file, and the tensor where there is one.
    The command line reports it as an input error (exit 2)."""


__all__ = ["ModelFileError", "ThinkaheadError"]
