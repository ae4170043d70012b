"""Step policies by name: who writes the next reasoning step, and whether a cheap draft is kept.

One registry, `POLICIES`: name -> the policy class, its pydantic options model (the settings a user
may write, `extra="forbid"`), and whether batch runs may use it. Everything else reads it: the
config model (`thinkahead.config.PolicyConfig` is built on `PolicySettings`, the union of the batch
policies' options), the CLI's choices, the server's model names. Adding a policy is one entry.

- `large`, `small`: baselines, one model writes everything;
- `specreason`: the small model drafts, the large model judges (SpecReason; `step_spec.specreason`);
- `arbitrage`: a router decides before drafting whether the large model should write (Arbitrage);
- `reflect`: the small model writes; a step that opens with a reflection cue ("wait", ...) is
  handed to the large model (Speculative Thinking);
- `collect`: router training pairs, both models write each step (one problem at a time: `thinkahead reason`).

A policy object is a stateless spec that any number of concurrent runs share; each run calls
`policy.start(ctx)` once and steps with the per-run object it returns (see `step_spec.base`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, create_model, field_validator, model_validator

from thinkahead.step_spec.base import (
    SCORE_MODES,
    NoOptions,
    Policy,
    PolicyOptions,
    PolicyRun,
    StepPolicy,
    Written,
    discard,
    check_policy_models,
    is_step_policy,
    outcome,
    with_reasoning,
    write_step,
)
from thinkahead.step_spec.baselines import Reflect, SingleModel
from thinkahead.step_spec.routing import Arbitrage, CollectPairs, router_features
from thinkahead.step_spec.specreason import JUDGES, REPAIRS, SpecReason


@dataclass(frozen=True, slots=True)
class PolicyEntry:
    """One registered policy: `factory(**preset, **options)` builds it; `options` validates its settings."""

    name: str
    factory: Callable[..., Policy]
    options: type[PolicyOptions]
    summary: str
    preset: Mapping[str, Any] = field(default_factory=dict)
    batch: bool = True  # batch runs, bench, the server and config files may use it

    def build(self, settings: Any = None, **objects: Any) -> Policy:
        """This policy from `settings` (a mapping or a model): its own options are read from it, the
        settings of other policies are ignored; `objects` go to the constructor as they are."""
        values: dict[str, Any] = {}
        for key in self.options.model_fields:
            if isinstance(settings, Mapping):
                if key in settings:
                    values[key] = settings[key]
            elif settings is not None and hasattr(settings, key):
                values[key] = getattr(settings, key)
        return self.factory(**self.preset, **values, **objects)


def _entries() -> tuple[PolicyEntry, ...]:
    return (
        PolicyEntry("large", SingleModel, NoOptions, "the large model writes every step", {"tier": "large"}),
        PolicyEntry("small", SingleModel, NoOptions, "the small model writes every step", {"tier": "small"}),
        PolicyEntry("specreason", SpecReason, SpecReason.Options, "the small model drafts, the large model judges"),
        PolicyEntry("arbitrage", Arbitrage, Arbitrage.Options, "a router picks the writer before each step"),
        PolicyEntry("reflect", Reflect, Reflect.Options, "steps opening with a reflection cue go to the large model"),
        PolicyEntry("collect", CollectPairs, CollectPairs.Options, "both models write; pairs for router training",
                    batch=False),
    )


POLICIES: dict[str, PolicyEntry] = {entry.name: entry for entry in _entries()}
ALL_POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)  # `thinkahead reason`
POLICY_NAMES: tuple[str, ...] = tuple(name for name, entry in POLICIES.items() if entry.batch)  # batch runs
# The large model writes every step, drafting its tokens with the small one (lossless): on the packaged pair no
# step policy lies above the line from `small` to `large` (docs/results/step_frontier.md, 125 held-out GSM8K
# problems); a step policy pays where the large model costs much more than the small one (a remote large model).
DEFAULT_POLICY = "large"


def policy_entry(name: str) -> PolicyEntry:
    if name not in POLICIES:
        raise ValueError(f"unknown step policy {name!r}; choose one of {', '.join(ALL_POLICY_NAMES)}")
    return POLICIES[name]


def make_policy(name: str, **options: Any) -> Policy:
    """A policy by name; options go to its constructor (e.g. threshold=5 for specreason)."""
    entry = policy_entry(name)
    return entry.factory(**entry.preset, **options)


def build_policy(settings: Any) -> Policy:
    """The policy `settings.name` names, from the settings it has (see `PolicyEntry.build`)."""
    name = settings["name"] if isinstance(settings, Mapping) else settings.name
    return policy_entry(name).build(settings)


class _Named(PolicyOptions):
    """The policy's name, checked against the registry; a bare name stands for `{name: NAME}`."""

    name: str = DEFAULT_POLICY

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @field_validator("name", mode="before")
    @classmethod
    def _registered(cls, value: Any) -> Any:
        if value not in POLICY_NAMES:
            why = "cannot run in batches" if value in POLICIES else "is unknown"
            raise ValueError(f"unknown policy {value!r}; choose one of {', '.join(POLICY_NAMES)} (it {why})")
        return value


def _settings_model() -> type[BaseModel]:
    """`_Named` plus every batch policy's options, in one flat model: a setting two policies share
    must be defined the same way in both."""
    bases: list[type[PolicyOptions]] = []
    seen: dict[str, tuple[str, Any]] = {}
    for entry in POLICIES.values():
        if not entry.batch or entry.options in bases:
            continue
        for key, info in entry.options.model_fields.items():
            shape = (repr(info.annotation), info.default, repr(info.metadata))
            if key in seen and seen[key][1] != shape:
                raise TypeError(f"policies {seen[key][0]!r} and {entry.name!r} define the setting {key!r} differently")
            seen[key] = (entry.name, shape)
        bases.append(entry.options)
    return create_model(  # type: ignore[call-overload,no-any-return]
        "PolicySettings", __base__=(*reversed(bases), _Named), __module__=__name__,
        name=(Literal[POLICY_NAMES], DEFAULT_POLICY),  # type: ignore[valid-type]
    )


PolicySettings = _settings_model()
PolicySettings.__doc__ = "The batch policies' settings in one model: `name` picks the policy, which reads its own."


__all__ = [
    "ALL_POLICY_NAMES", "DEFAULT_POLICY", "JUDGES", "POLICIES", "POLICY_NAMES", "REPAIRS", "SCORE_MODES", "Arbitrage",
    "CollectPairs", "NoOptions", "Policy", "PolicyEntry", "PolicyOptions", "PolicyRun", "PolicySettings", "Reflect",
    "SingleModel", "SpecReason", "StepPolicy", "Written", "build_policy", "check_policy_models", "discard", "is_step_policy",
    "make_policy",
    "outcome", "policy_entry", "router_features", "with_reasoning", "write_step",
]
