"""User configuration of an `Orchestrator`, as pydantic models (`extra="forbid"`: typos are errors).

Loadable from YAML, TOML or JSON:

```yaml
small: qwen2.5-coder-0.5b
large: {spec: qwen2.5-coder-1.5b, dtype: int8}
policy: {name: specreason, threshold: 7}
workflow: cot
concurrency: 2
budget: {max_tokens: 4096}
```
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator

from thinkahead.orchestrator.budget import RetryPolicy, RunBudget
from thinkahead.step_spec.loop import StepBudget
from thinkahead.step_spec.policies import PolicySettings
from thinkahead.step_spec.segment import SegmentConfig
from thinkahead.models.engine.config import ENGINE_SETTINGS, EngineConfig, scheduler_conflicts
from thinkahead.models.loader import REMOTE_PREFIXES
from thinkahead.token_spec.names import MODEL_DRAFT_KINDS

# A run's wall-clock deadline unless `budget.max_wall_s` says otherwise (`null`: none). Runs of the
# local models take seconds to a few minutes; each model call is bounded too, by its backend's
# `call_timeout_s` (thinkahead.models.http.DEFAULT_CALL_TIMEOUT_S) and `budget.max_call_s`.
DEFAULT_RUN_WALL_S = 1800.0
# Runs in flight at once (`run`, `serve`, the SDK's batches) unless `concurrency` says otherwise: a local model
# decodes them together, one forward per step (thinkahead/models/engine/scheduler.py). 8 GSM8K chains on the 1.5B: 2.5x the
# tokens per second of one at a time, 16 no more (docs/results/batching.md); `run` on 20 problems 2.0x faster.
CONCURRENCY = 8
# Engine settings a remote model's config may carry, unused: `--dtype` applies to both models of a command
REMOTE_TOLERATED = ("dtype",)
PARTIAL = "partial"  # validation context key: a config file that command-line options complete


def one_of(value: str, names: Iterable[str], what: str) -> str:
    """`value` if a registry (`names`) holds it; a ValueError listing the choices otherwise."""
    names = tuple(names)
    if value not in names:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(names)}")
    return value


class ModelConfig(EngineConfig, frozen=False):
    """A model: its spec (see `load_model`), and for a local one how its engine runs (`EngineConfig`'s fields)."""

    spec: str
    tokenizer: str | None = Field(default=None, description="remote models: a model spec whose chat template to use")
    record: str | None = Field(default=None, description="local models: append every generation's token ids here")

    @field_validator("spec")
    @classmethod
    def _spec_resolves(cls, value: str) -> str:
        from thinkahead.models.loader import check_model_spec

        return check_model_spec(value)

    def options(self) -> dict[str, Any]:
        options: dict[str, Any] = {key: getattr(self, key) for key in ENGINE_SETTINGS}
        if self.tokenizer is not None:
            options["tokenizer"] = self.tokenizer
        if self.record is not None:
            options["record"] = self.record
        return options

    @model_validator(mode="after")
    def _tokenizer_only_for_remote(self) -> ModelConfig:
        remote = self.spec.startswith(REMOTE_PREFIXES)
        if self.tokenizer is not None and not remote:
            raise ValueError(f"model {self.spec!r}: tokenizer is only for remote (openai:/sglang:) models")
        if self.record is not None and remote:
            raise ValueError(f"model {self.spec!r}: record is only for local models (remote servers keep their own ids)")
        engine_only = [k for k in ENGINE_SETTINGS if k not in REMOTE_TOLERATED and k in self.model_fields_set
                       and getattr(self, k) != EngineConfig.model_fields[k].default]
        if remote and engine_only:
            raise ValueError(f"model {self.spec!r}: {', '.join(engine_only)} {'is' if len(engine_only) == 1 else 'are'} "
                             f"only for local models (a server runs as it was started)")
        return self


class PolicyConfig(PolicySettings):
    """The step policy of `think` nodes and its settings (`extra="forbid"`).

    Built from the policy registry (`thinkahead.step_spec.policies.POLICIES`): `name` is one of the
    batch policies, the other fields are the union of their options (threshold, judge, ... for
    specreason; router for arbitrage). Each policy reads its own settings and ignores the others',
    so switching `name` keeps them (`policy: {name: specreason, threshold: 7}` or `policy: specreason`).
    """

    def build(self):
        from thinkahead.step_spec.policies import build_policy

        return build_policy(self)


def explain(exc: ValidationError, source: str = "config") -> str:
    """A pydantic error as one line per problem: `SOURCE: field.path: message (got VALUE)`."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        message = " ".join(str(err["msg"]).removeprefix("Value error, ").split())  # one line
        got = err.get("input")
        shown = "" if isinstance(got, dict) or repr(got) in message else f" (got {got!r:.80})"
        lines.append(f"{source}: {where}: {message}{shown}")
    return "\n".join(lines)


# Settings that change how a batch runs but not what its runs compute: a store written with one
# value may be resumed with another (see `OrchestratorConfig.store_identity`).
# The engine's memory and batching settings move no token (the kernels are batch-invariant), and stores written
# before they were settings lack them.
ENGINE_NEUTRAL = ("kv_sessions", "kv_tokens", "kv_live_tokens", "max_batch_rows", "prefill_chunk")
RESUME_NEUTRAL = ("concurrency", "retry", "small.record", "large.record", "budget.max_call_s", "batch_budget",
                  *(f"{tier}.{key}" for tier in ("small", "large") for key in ENGINE_NEUTRAL))


class OrchestratorConfig(BaseModel, extra="forbid"):
    """Everything an `Orchestrator` needs; each field has a working default."""

    small: ModelConfig = ModelConfig(spec="qwen2.5-coder-0.5b")
    large: ModelConfig = ModelConfig(spec="qwen2.5-coder-1.5b")
    policy: PolicyConfig = PolicyConfig()
    workflow: str = "cot"
    workflow_options: dict[str, Any] = Field(default_factory=dict)
    segment: SegmentConfig = SegmentConfig()
    steps: StepBudget = StepBudget()
    budget: RunBudget = RunBudget(max_wall_s=DEFAULT_RUN_WALL_S)
    batch_budget: RunBudget = RunBudget()
    retry: RetryPolicy = RetryPolicy()
    concurrency: int = Field(default=CONCURRENCY, ge=1)
    token_spec: bool = True

    @field_validator("budget", mode="before")
    @classmethod
    def _run_deadline_by_default(cls, value: Any) -> Any:
        """A run budget that leaves `max_wall_s` out gets `DEFAULT_RUN_WALL_S`; `null` lifts it."""
        if isinstance(value, dict) and "max_wall_s" not in value:
            return {**value, "max_wall_s": DEFAULT_RUN_WALL_S}
        if isinstance(value, RunBudget) and "max_wall_s" not in value.model_fields_set:
            return value.model_copy(update={"max_wall_s": DEFAULT_RUN_WALL_S})
        return value

    @field_validator("small", "large", mode="before")
    @classmethod
    def _model_from_string(cls, value: Any) -> Any:
        return {"spec": value} if isinstance(value, str) else value

    @field_validator("workflow")
    @classmethod
    def _known_workflow(cls, value: str) -> str:
        from thinkahead.workflows import WORKFLOWS

        return one_of(value, WORKFLOWS, "workflow")

    @model_validator(mode="after")
    def _draft_models_fit(self) -> OrchestratorConfig:
        """Only the large model drafts with another (the small one, which must be local); the small one alone."""
        if self.small.drafter in MODEL_DRAFT_KINDS:
            raise ValueError(f"small.drafter {self.small.drafter!r} needs a draft model, and the small model has none "
                             f"(the large model drafts with the small one); choose a model-free drafter")
        if self.large.drafter in MODEL_DRAFT_KINDS and self.small.spec.startswith(REMOTE_PREFIXES):
            raise ValueError(f"large.drafter {self.large.drafter!r} drafts with the small model, which must be local "
                             f"(got {self.small.spec})")
        unlike = scheduler_conflicts(self.large, self.small)
        if self.large.drafter in MODEL_DRAFT_KINDS and unlike:
            raise ValueError(f"large.drafter {self.large.drafter!r} runs both models on the small one's scheduler: "
                             f"{', '.join(unlike)} cannot both hold; give both models the same")
        return self

    @model_validator(mode="after")
    def _policy_fits_the_models(self, info: ValidationInfo) -> OrchestratorConfig:
        """A policy setting that needs token scores from a backend that can never return them
        (`loader.SCORELESS_PREFIXES`) is refused here, before any model loads; an `openai:` server is asked
        once the models load (`OpenAIModel.probe_scores`), model instances by the runtime. Skipped for a
        config file read as the base of command-line options (`from_file(partial=True)`): the check runs on
        what they make of it (a file's large model is fine with `--policy large`)."""
        from thinkahead.models.loader import scores_tokens
        from thinkahead.step_spec.specreason import scoring_needs

        if (info.context or {}).get(PARTIAL):
            return self
        if self.policy.name == "specreason":
            for tier, why in scoring_needs(self.policy).items():
                spec = getattr(self, tier).spec
                if not scores_tokens(spec):
                    raise ValueError(f"policy: specreason's {why}, and {spec} returns none")
        return self

    def store_identity(self) -> dict[str, Any]:
        """The settings a result store records: a resume must match them (all but `RESUME_NEUTRAL`)."""
        data = self.model_dump(mode="json")
        for dotted in RESUME_NEUTRAL:
            *parents, leaf = dotted.split(".")
            node = data
            for key in parents:
                node = node.get(key, {})
            node.pop(leaf, None)
        return data

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], partial: bool = False) -> OrchestratorConfig:
        """Read a .yaml/.yml, .toml or .json file; errors name the file and the field. `partial`: the file is
        the base that command-line options complete; the checks across settings wait for the whole."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        text = path.read_text(encoding="utf-8")
        suffix = path.suffix.lower()
        try:
            if suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            elif suffix == ".toml":
                data = tomllib.loads(text)
            elif suffix == ".json":
                data = json.loads(text)
            else:
                raise ValueError(f"config file {path} must end in .yaml, .yml, .toml or .json")
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"config file {path} is not valid {suffix[1:].upper()}: {exc}") from exc
        except Exception as exc:
            if type(exc).__module__.startswith("yaml"):
                raise ValueError(f"config file {path} is not valid YAML: {exc}") from exc
            raise
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping at the top level")
        try:
            return cls.model_validate(data, context={PARTIAL: partial})
        except ValidationError as exc:
            raise ValueError(explain(exc, f"config file {path}")) from None


@cache
def _defaults() -> OrchestratorConfig:
    return OrchestratorConfig()


def default(path: str) -> Any:
    """The built-in default of one setting, by its dotted path in `OrchestratorConfig`
    (`"small.spec"`, `"policy.threshold"`, `"steps.max_tokens"`): the CLI's options read their
    defaults here, so each lives once, in the models above."""
    node: Any = _defaults()
    for key in path.split("."):
        if not isinstance(node, BaseModel) or key not in type(node).model_fields:
            raise KeyError(f"OrchestratorConfig has no setting {path!r}")
        node = getattr(node, key)
    return node
