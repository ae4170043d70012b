"""The CLI reads its names and defaults from the registries and the config models: `reason` builds
its policy through `POLICIES`, `serve` takes `--concurrency`, else the config file's, else the config's
default, and every default a command shows is the config's."""

from __future__ import annotations

import asyncio
import json

import pytest
import uvicorn
from click.testing import CliRunner

from thinkahead.cli import main
from thinkahead.config import CONCURRENCY, default
from thinkahead.models import ScriptedModel
from thinkahead.step_spec.policies import POLICY_NAMES

from tests.llm_judge import LLM_JUDGE_FLAGS
from tests.test_step_policies import AgreeingModel

REMOTE = "openai:qwen@http://127.0.0.1:9/v1"  # built without connecting: no weights load


@pytest.fixture
def reason_loop(monkeypatch):
    """`thinkahead reason` over scripted models: the loop it builds is kept for the test to read."""
    import thinkahead.models.loader
    import thinkahead.step_spec.loop as loop_module

    built = {}
    real_loop = loop_module.StepLoop

    def loop(small, large, policy, *args, **kwargs):
        built["loop"] = real_loop(small, large, policy, *args, **kwargs)
        return built["loop"]

    def model(spec, dtype):
        built.setdefault("dtypes", []).append(dtype)
        kind = {"gaps": {}} if built.get("scores", True) else {}  # AgreeingModel scores tokens, ScriptedModel not
        scripted = AgreeingModel if kind else ScriptedModel
        return scripted(outputs=["So \\boxed{391}."], logprobs=[{"9": -0.05}], name=spec, **kind)

    def pair(small, large, small_options, large_options):
        built["drafter"] = large_options["drafter"]
        return model(small, small_options["dtype"]), model(large, large_options["dtype"])

    monkeypatch.setattr(loop_module, "StepLoop", loop)
    monkeypatch.setattr(thinkahead.models.loader, "load_pair", pair)
    return built


def test_reason_builds_each_policy_from_the_registry_with_its_own_defaults(reason_loop, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    result = CliRunner().invoke(main, ["reason", "What is 17 * 23?", "--policy", "collect", "--pairs", str(pairs),
                                       "--threshold", "5", "--judge", "agreement", "--json"])
    assert result.exit_code == 0, result.output
    policy = reason_loop["loop"].policy
    # collect reads the options it has (the threshold given), keeps its own default score mode
    # (specreason's differs) and ignores specreason's (--judge)
    assert (policy.name, policy.pairs_path, policy.threshold, policy.score_mode) == ("collect", pairs, 5.0, "expected")
    assert json.loads(result.output)["steps"][0]["text"] == "So \\boxed{391}."
    assert reason_loop["dtypes"] == [default("small.dtype"), default("large.dtype")]
    assert reason_loop["drafter"] == default("large.drafter")

    result = CliRunner().invoke(main, ["reason", "q", "--policy", "specreason", "--judge", "agreement", "--repair", "token",
                                       "--first-large", "1"])
    assert result.exit_code == 0, result.output
    policy = reason_loop["loop"].policy
    assert (policy.name, policy.judge, policy.repair, policy.first_large_steps, policy.threshold) == (
        "specreason", "agreement", "token", 1, default("policy.threshold"))


def test_reason_refuses_bad_policy_options_before_loading_models(reason_loop):
    result = CliRunner().invoke(main, ["reason", "q", "--policy", "specreason", "--threshold", "12"])
    assert result.exit_code == 2 and "policy 'specreason': threshold" in result.output
    result = CliRunner().invoke(main, ["reason", "q", "--policy", "collect"])
    assert result.exit_code == 2 and "--policy collect needs --pairs FILE.jsonl" in result.output
    result = CliRunner().invoke(main, ["reason", "q", "--policy", "specreason", "--score-mode", "mean"])
    assert result.exit_code == 2 and "'greedy', 'expected'" in result.output  # the Literal's values
    assert "dtypes" not in reason_loop


@pytest.mark.parametrize(("given", "expected"), [
    ([], CONCURRENCY),  # the one default of run and serve
    (["--concurrency", "3"], 3),
])
def test_serve_concurrency_is_the_option_else_the_config_file_else_the_default(monkeypatch, tmp_path, given, expected):
    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.update(app=app))
    args = ["serve", "--small", REMOTE, "--large", REMOTE, *LLM_JUDGE_FLAGS, *given]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert started["app"].concurrency == expected
    asyncio.run(started["app"].aclose())
    config = tmp_path / "serve.yaml"
    config.write_text("concurrency: 2\n")
    result = CliRunner().invoke(main, [*args, "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert started["app"].concurrency == (3 if given else 2)  # the file's value, unless the option is given
    asyncio.run(started["app"].aclose())


@pytest.mark.parametrize(("command", "param", "setting"), [
    ("generate", "model", "small.spec"),
    ("generate", "dtype", "small.dtype"),
    ("generate", "drafter", "small.drafter"),
    ("generate", "max_draft", "small.max_draft"),
    ("simulate", "max_draft", "small.max_draft"),
    ("reason", "small_spec", "small.spec"),
    ("reason", "large_spec", "large.spec"),
    ("reason", "dtype", "large.dtype"),
    ("reason", "policy", "policy.name"),
    ("reason", "max_steps", "steps.max_steps"),
    ("reason", "max_tokens", "steps.max_tokens"),
    ("reason", "step_tokens", "segment.max_step_tokens"),
])
def test_command_defaults_are_the_config_defaults(command, param, setting):
    option = next(p for p in main.commands[command].params if p.name == param)
    assert option.default == default(setting)


def test_the_shared_options_show_the_config_defaults():
    helps = {p.name: p.help for p in main.commands["run"].params}
    for param, setting in (("small", "small.spec"), ("dtype", "large.dtype"), ("judge", "policy.judge"),
                           ("repair", "policy.repair"), ("max_steps", "steps.max_steps"),
                           ("max_tokens", "steps.max_tokens"), ("step_tokens", "segment.max_step_tokens"),
                           ("concurrency", "concurrency"), ("policy", "policy.name"), ("workflow", "workflow")):
        assert helps[param].endswith(f"[{default(setting)}].") and helps[param].count("[") == 1, helps[param]
    with pytest.raises(KeyError, match="no setting 'steps.max_stepz'"):
        default("steps.max_stepz")


def test_the_gate_and_routers_reach_the_policy_and_bad_values_are_named(reason_loop, tmp_path):
    result = CliRunner().invoke(main, ["reason", "q", "--policy", "specreason", "--gate-logprob", "-0.2", "--pre-router", "trained"])
    assert result.exit_code == 0, result.output
    policy = reason_loop["loop"].policy
    assert (policy.gate_logprob, policy.pre_router, type(policy.router).__name__) == (-0.2, "trained", "LogisticRouter")
    result = CliRunner().invoke(main, ["reason", "q", "--policy", "specreason", "--gate-logprob", "off"])
    assert result.exit_code == 0 and reason_loop["loop"].policy.gate_logprob is None
    result = CliRunner().invoke(main, ["reason", "q", "--policy", "specreason", "--gate-logprob", "sure"])
    assert result.exit_code == 2 and "'sure' is neither a log-probability (e.g. -0.1) nor 'off'" in result.output
    result = CliRunner().invoke(main, ["reason", "q", "--policy", "arbitrage"])
    assert result.exit_code == 0, result.output
    assert reason_loop["loop"].policy.router.provenance["rule"] == "agreement"  # the shipped router by default
    result = CliRunner().invoke(main, ["reason", "q", "--policy", "specreason", "--gate-logprob", "0.5"])
    assert result.exit_code == 2 and "gate_logprob" in result.output
    result = CliRunner().invoke(main, ["reason", "q", "--policy", "arbitrage", "--router", str(tmp_path / "none.json")])
    assert result.exit_code == 2 and "unknown router" in result.output
    # run and bench take them too; a bad one is an input error (exit 2) before any model loads
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"id": "a", "question": "q", "answer": "1"}\n')
    result = CliRunner().invoke(main, ["run", str(tasks), "-o", str(tmp_path / "r.jsonl"), "--gate-logprob", "1"])
    assert result.exit_code == 2 and "gate_logprob" in result.output


def test_a_server_that_cannot_be_asked_for_scores_is_refused_before_serving():
    # an OpenAI-compatible server is asked at start whether it scores tokens (the default check, agreement, and
    # the gate need them); one that cannot be asked is refused before serving, naming the setting and the server
    specreason = ["serve", "--small", REMOTE, "--large", REMOTE, "--policy", "specreason"]
    result = CliRunner().invoke(main, specreason)
    assert result.exit_code == 2 and "judge 'agreement' needs token scores from the large model" in result.output
    assert "--judge llm" in result.output and "http://127.0.0.1:9" in result.output
    result = CliRunner().invoke(main, [*specreason, "--judge", "llm"])
    assert result.exit_code == 2 and "gate_logprob needs token log-probabilities from the small model" in result.output
    assert "--gate-logprob off" in result.output


def test_a_default_the_models_cannot_run_is_refused_naming_the_setting(reason_loop, monkeypatch):
    # model instances without scores (here: scripted models), checked when the loop is built
    reason_loop["scores"] = False
    result = CliRunner().invoke(main, ["reason", "q", "--policy", "specreason"])
    assert result.exit_code == 2 and "judge 'agreement' needs token scores" in result.output
    assert "ScriptedModel" in result.output and "loop" not in reason_loop
    result = CliRunner().invoke(main, ["reason", "q", "--policy", "specreason", *LLM_JUDGE_FLAGS])
    assert result.exit_code == 0, result.output


def test_a_config_files_remote_large_model_works_with_a_policy_given_on_the_command_line(tmp_path) -> None:
    """A file naming a remote large model with `--policy` from the command line: the check across settings runs
    on the whole (an `openai:` server is asked whether it scores tokens once the models load)."""
    from thinkahead.cli.options import InputError, build_settings

    config = tmp_path / "remote.yaml"
    config.write_text(f'large: {{spec: "{REMOTE}", tokenizer: qwen2.5-coder-1.5b}}\n')
    none = dict.fromkeys(("small", "large", "dtype", "threshold", "max_steps", "max_tokens", "step_tokens",
                          "no_token_spec"))
    data = build_settings(config, **none, policy="large")
    assert data["policy"]["name"] == "large" and data["large"]["spec"] == REMOTE
    # with specreason too: whether the server scores tokens is asked once the models are loaded
    assert build_settings(config, **none, policy="specreason")["policy"]["name"] == "specreason"


@pytest.mark.parametrize("args, refused", [
    (["run", "--gate-logprob", "-0.5"], "--gate-logprob is a setting of specreason; the policy large would not read it"),
    (["run", "--policy", "arbitrage", "--margin", "2"], "--margin is a setting of specreason; the policy arbitrage"),
    (["run", "--router", "heuristic"], "--router is a setting of arbitrage; the policy large"),
    (["bench", "--policies", "large,small", "--judge", "llm"], "the policies large, small would not read it"),
])
def test_a_policy_option_the_runs_would_not_read_is_refused_by_name(tmp_path, args, refused):
    # the default policy is large, which has no settings: `--gate-logprob` there used to change nothing, silently
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"id": "a", "question": "q", "answer": "1"}\n')
    command, *options = args
    out = ["-o", str(tmp_path / ("r.jsonl" if command == "run" else "b"))]
    result = CliRunner().invoke(main, [command, str(tasks), *out, *options, "--small", REMOTE, "--large", REMOTE])
    assert result.exit_code == 2 and refused in result.output, result.output
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "b").exists()  # before anything was written


def test_a_policy_option_is_taken_where_a_policy_run_reads_it(tmp_path):
    from thinkahead.cli.options import build_settings

    none = dict.fromkeys(("config_path", "small", "large", "dtype", "threshold", "max_steps", "max_tokens",
                          "step_tokens", "no_token_spec"))
    assert build_settings(**none, gate_logprob=-0.5, policy="specreason")["policy"]["gate_logprob"] == -0.5
    assert build_settings(**none, router="heuristic", reads=["large", "arbitrage"])["policy"]["router"] == "heuristic"
    # serve: a request names its policy, so any policy's option may be read
    assert build_settings(**none, margin=2.0, reads=POLICY_NAMES)["policy"]["margin"] == 2.0
