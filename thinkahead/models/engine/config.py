"""`EngineConfig`: a local model's engine settings, each default defined once.

`LocalModel` takes them (`LocalModel(spec, engine=EngineConfig(...))`, or the same fields as keywords), a config
file's `small:`/`large:` entries are `ModelConfig`s built on them (thinkahead/config.py), and the CLI, `serve`
and the SDK read their defaults from here. The numbers behind each default sit with the name it reads:
`DEFAULT_DTYPE` (engine/dtypes.py), the drafter names, `MAX_DRAFT`, `PREFILL_CHUNK` and `MAX_BATCH_ROWS`
(token_spec/names.py), `KV_SESSIONS`, `KV_MEMORY_SHARE` and `KV_LIVE_SHARE` (below). Threads are the process's
(`THINKAHEAD_THREADS`, engine/weights/load.py), not a model's: torch has one pool.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator

from thinkahead.models.engine.dtypes import DEFAULT_DTYPE
from thinkahead.token_spec.names import (
    AUTO_DRAFTER, DRAFTER_CHOICES, MAX_BATCH_ROWS, MAX_DRAFT, PREFILL_CHUNK, check_drafter,
)

KV_SESSIONS = 16  # finished generations whose KV is kept for prefix reuse (a batch of 8 runs, small and large steps)
KV_MEMORY_SHARE = 0.25  # of the memory free at load, what the kept KV (prefix reuse) may hold by default
KV_LIVE_SHARE = 0.5  # of the memory free at load, what live generations may reserve by default


class EngineConfig(BaseModel, extra="forbid", frozen=True):
    """How a local model runs: its weights' dtype, token drafting, KV memory and batching."""

    dtype: str = Field(default=DEFAULT_DTYPE, description="auto (gguf for GGUF files the native kernel runs, else "
                       "int8), gguf, int8, bfloat16 or float32 (engine/dtypes.py)")
    drafter: str = Field(default=AUTO_DRAFTER, description="token drafter: auto (head where a draft head is packaged "
                         "for the model, else combined) or a named one; hybrid/draft-model (a large model) draft with "
                         "the small local model; head with the model's packaged draft head")
    max_draft: int = Field(default=MAX_DRAFT, gt=0, description="draft tokens per verify round at most")
    kv_sessions: int = Field(default=KV_SESSIONS, gt=0, description="finished generations whose KV is kept for "
                             "prefix reuse")
    kv_tokens: int | None = Field(default=None, gt=0, description="tokens the kept KV holds in all (null: "
                                  f"{KV_MEMORY_SHARE:g} of the memory free at load)")
    kv_live_tokens: int | None = Field(default=None, gt=0, description="KV tokens live generations may reserve in "
                                       "all, each its prompt and longest output; more wait in arrival order (null: "
                                       f"{KV_LIVE_SHARE:g} of the memory free at load)")
    max_batch_rows: int = Field(default=MAX_BATCH_ROWS, gt=0, description="rows of one step's forward at most")
    prefill_chunk: int = Field(default=PREFILL_CHUNK, gt=0, description="prompt tokens per step while other "
                               "sequences decode")

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        from thinkahead.models.engine.weights.load import DTYPES

        if value not in DTYPES:
            raise ValueError(f"unknown dtype {value!r}; choose one of {', '.join(DTYPES)}")
        return value

    @field_validator("drafter")
    @classmethod
    def _known_drafter(cls, value: str) -> str:
        return check_drafter(value, DRAFTER_CHOICES)

    @classmethod
    def of(cls, base: EngineConfig | None = None, **settings: Any) -> EngineConfig:
        """`base` (the defaults if None) with `settings` in place of its values; a ValueError naming each bad one."""
        data = (base or cls()).model_dump(include=set(cls.model_fields))  # a ModelConfig brings its spec too
        unknown = sorted(set(settings) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"unknown engine setting(s) {', '.join(unknown)}; the settings are "
                             f"{', '.join(cls.model_fields)}")
        try:
            return cls.model_validate({**data, **settings})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')} "
                                 f"(got {e.get('input')!r:.60})" for e in exc.errors())
            raise ValueError(f"engine settings: {problems}") from None


ENGINE_SETTINGS = tuple(EngineConfig.model_fields)  # what a remote model drops (a server runs as it was started)
SCHEDULER_SETTINGS = ("max_batch_rows", "prefill_chunk")  # a pair that drafts together runs on one scheduler


def scheduler_conflicts(large: EngineConfig, small: EngineConfig) -> list[str]:
    """The scheduler settings in which a large model that drafts with `small` differs from it (they cannot both
    hold: the small model's scheduler runs both), each as "NAME LARGE'S against SMALL'S"."""
    return [f"{key} {getattr(large, key)} against {getattr(small, key)}"
            for key in SCHEDULER_SETTINGS if getattr(large, key) != getattr(small, key)]
