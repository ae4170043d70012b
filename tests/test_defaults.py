"""One defaults table: every entry point, given no options, resolves the same dtype, drafter, draft budget, step
limits and policy (the config models define them; the CLI, the server, `reason`, `generate`, the SDK and
`LocalModel` read them)."""

from __future__ import annotations

import inspect

import click

from thinkahead.cli.bench import bench
from thinkahead.cli.generate import generate
from thinkahead.cli.options import build_settings
from thinkahead.cli.reason import reason
from thinkahead.cli.run import run
from thinkahead.cli.serve import serve
from thinkahead.config import OrchestratorConfig
from thinkahead.models.engine.config import EngineConfig
from thinkahead.models.local import LocalModel
from thinkahead.sdk import Orchestrator
from thinkahead.step_spec.loop import StepBudget
from thinkahead.step_spec.segment import SegmentConfig
from thinkahead.token_spec.presets import build_decoder


def option_defaults(command: click.Command) -> dict:
    return {p.name: p.default for p in command.params}


def no_options(command: click.Command) -> OrchestratorConfig:
    """The config a batch command builds when it is given no option."""
    given = option_defaults(command)
    names = set(inspect.signature(build_settings).parameters) | {"policy", "concurrency", "workflow"}
    return OrchestratorConfig.model_validate(build_settings(**{k: v for k, v in given.items() if k in names}))


def summary(config: OrchestratorConfig) -> dict:
    return {"dtype": (config.small.dtype, config.large.dtype), "drafter": (config.small.drafter, config.large.drafter),
            "max_draft": (config.small.max_draft, config.large.max_draft),
            "max_step_tokens": config.segment.max_step_tokens, "steps": config.steps.model_dump(),
            "policy": config.policy.name, "concurrency": config.concurrency}


def test_every_entry_point_resolves_the_same_defaults() -> None:
    table = summary(OrchestratorConfig())
    assert table["drafter"] == ("auto", "auto") and table["dtype"] == ("auto", "auto")
    for command in (run, serve, bench):
        assert summary(no_options(command)) == table, command.name
    assert summary(Orchestrator().config) == table
    # the commands that build models themselves
    r = option_defaults(reason)
    assert (r["dtype"], r["drafter"], r["policy"]) == (table["dtype"][1], table["drafter"][1], table["policy"])
    assert (r["step_tokens"], r["max_steps"], r["max_tokens"]) == (
        table["max_step_tokens"], table["steps"]["max_steps"], table["steps"]["max_tokens"])
    g = option_defaults(generate)
    assert (g["dtype"], g["drafter"], g["max_draft"]) == (table["dtype"][0], table["drafter"][0], table["max_draft"][0])
    # the library's own defaults
    assert not {"dtype", "drafter", "max_draft"} & set(inspect.signature(LocalModel).parameters)  # read from:
    engine = EngineConfig()
    assert (engine.dtype, engine.drafter, engine.max_draft) == (table["dtype"][0], table["drafter"][0],
                                                                table["max_draft"][0])
    assert inspect.signature(build_decoder).parameters["max_draft"].default == table["max_draft"][0]
    assert SegmentConfig().max_step_tokens == table["max_step_tokens"]
    assert StepBudget().model_dump() == table["steps"]
