"""`ThinkaheadError`, defined in the lowest layer that raises library errors, so that every layer above
(models, verifiers, step_spec, orchestrator, workflows, the top) can subclass it without importing
upwards. Import it as `thinkahead.errors.ThinkaheadError`."""

from __future__ import annotations


class ThinkaheadError(Exception):
    """Base class of the exceptions thinkahead raises on purpose."""


__all__ = ["ThinkaheadError"]
