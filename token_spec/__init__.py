"""Token-level speculation: suffix-tree drafting, lossless verification, the draft/verify loop.

Public names are imported lazily, so `import thinkahead.token_spec` does not load torch until
a model-facing class is used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Draft": "draft",
    "SuffixTree": "suffix_tree",
    "SuffixCache": "suffix_cache",
    "Drafter": "drafters",
    "SuffixDrafter": "drafters",
    "PromptLookupDrafter": "drafters",
    "DraftModelDrafter": "drafters",
    "HybridDrafter": "drafters",
    "CombinedDrafter": "drafters",
    "merge_drafts": "drafters",
    "SessionStats": "suffix_cache",
    "SamplingParams": "verify",
    "FixedController": "controller",
    "MatchLengthController": "controller",
    "AdaptiveController": "controller",
    "SpeculativeDecoder": "decoder",
    "GenerationResult": "decoder",
    "SpecStats": "stats",
    "replay": "simulator",
    "replay_sessions": "simulator",
    "Turn": "simulator",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'thinkahead.token_spec' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
