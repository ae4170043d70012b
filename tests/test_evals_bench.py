"""The bench matrix: its configurations, and defaults read from the config models, never restated."""

from __future__ import annotations

import pytest
from thinkahead.step_spec.specreason import JUDGES, REPAIRS

from thinkahead import config
from thinkahead.config import OrchestratorConfig, default
from thinkahead.evals.bench import BenchConfig, matrix


def labels(configs: list[BenchConfig]) -> list[str]:
    return [c.label for c in configs]


def test_matrix_sweeps_thresholds_for_the_llm_judge_only():
    assert labels(matrix(["large", "specreason"], [3, 7], "on", ("llm",))) == ["large", "specreason@3", "specreason@7"]
    # the default judge is the agreement check: no threshold to sweep
    assert labels(matrix(["large", "specreason"], [3, 7], "on")) == ["large", "specreason-agreement"]
    assert labels(matrix(["specreason"], [3], "both", ("llm", "agreement"), "token")) == [
        "specreason@3", "specreason-agreement+token", "specreason@3/no-token-spec",
        "specreason-agreement+token/no-token-spec",
    ]


def test_matrix_and_bench_config_default_to_the_config_models(monkeypatch):
    assert (default("policy.judge"), default("policy.repair")) == ("agreement", "step")
    assert BenchConfig("large").judge in JUDGES and BenchConfig("large").repair in REPAIRS
    assert labels(matrix(["specreason"], [3, 7], "on")) == ["specreason-agreement"]
    changed = OrchestratorConfig(policy={"name": "specreason", "judge": "agreement", "repair": "token"})
    monkeypatch.setattr(config, "_defaults", lambda: changed)
    assert (BenchConfig("specreason").judge, BenchConfig("specreason").repair) == ("agreement", "token")
    # no judges given: the default judge (agreement, so no threshold sweep) with the default repair
    assert labels(matrix(["specreason"], [3, 7], "on")) == ["specreason-agreement+token"]
    judged = OrchestratorConfig(policy={"name": "specreason", "judge": "llm", "gate_logprob": None})
    monkeypatch.setattr(config, "_defaults", lambda: judged)
    assert labels(matrix(["specreason"], [3, 7], "on")) == ["specreason@3", "specreason@7"]


def test_matrix_refuses_unknown_names():
    with pytest.raises(ValueError, match="judges must be among llm, agreement"):
        matrix(["specreason"], [], "on", ("prm",))
    with pytest.raises(ValueError, match="repair must be one of step, token, got 'word'"):
        matrix(["specreason"], [], "on", ("agreement",), "word")
    with pytest.raises(ValueError, match="token_spec must be 'on', 'off' or 'both'"):
        matrix(["large"], [], "sometimes")
