"""The SDK: `Orchestrator` from arguments or config files, batches with a store, nesting orchestrators."""

from __future__ import annotations

import asyncio

import pytest

from thinkahead import Orchestrator, OrchestratorConfig
from thinkahead.models import ScriptedModel
from thinkahead.models.loader import load_model
from thinkahead.orchestrator import END, START, StepGraph
from thinkahead.orchestrator.store import ResultStore

from tests.llm_judge import LLM_JUDGE, LLM_SPECREASON

JUDGE_YES = [{"9": -0.05}]


def scripted_pair():
    small = ScriptedModel(outputs=["Multiply.\n\n", "So \\boxed{391}."])
    large = ScriptedModel(outputs=["\\boxed{391}"], logprobs=JUDGE_YES)
    return small, large


def test_config_files_in_yaml_toml_and_json(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("small: hf:org/m-small\nlarge: {spec: hf:org/m-large, dtype: bfloat16}\npolicy: {name: specreason, threshold: 5}\n"
                         "concurrency: 3\nbudget: {max_tokens: 900}\n")
    toml_file = tmp_path / "c.toml"
    toml_file.write_text('small = "hf:org/m-small"\nworkflow = "refine"\n[policy]\nname = "reflect"\n')
    json_file = tmp_path / "c.json"
    json_file.write_text('{"policy": "large", "token_spec": false}')
    y = OrchestratorConfig.from_file(yaml_file)
    assert (y.small.spec, y.large.spec, y.large.dtype, y.policy.threshold, y.concurrency, y.budget.max_tokens) == (
        "hf:org/m-small", "hf:org/m-large", "bfloat16", 5.0, 3, 900)
    t = OrchestratorConfig.from_file(toml_file)
    assert (t.workflow, t.policy.name) == ("refine", "reflect")
    j = OrchestratorConfig.from_file(json_file)
    assert (j.policy.name, j.token_spec) == ("large", False)


def test_policy_config_builds_the_token_repair() -> None:
    config = OrchestratorConfig.model_validate(
        {"policy": {"name": "specreason", "judge": "agreement", "margin": 0.5, "word_margin": 3, "repair": "token",
                    "max_corrections": 2}})
    policy = config.policy.build()
    assert (policy.judge, policy.margin, policy.word_margin, policy.repair, policy.max_corrections) == (
        "agreement", 0.5, 3.0, "token", 2)
    for bad, field in (({"repair": "word"}, "repair"), ({"word_margin": 0}, "word_margin"),
                       ({"max_corrections": 0}, "max_corrections")):
        with pytest.raises(ValueError, match=field):
            OrchestratorConfig.model_validate({"policy": {"name": "specreason", **bad}})


def test_config_errors_name_the_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: {name: specreason}\nconcurency: 2\n")
    with pytest.raises(ValueError, match=r"(?s)bad.yaml.*concurency"):
        OrchestratorConfig.from_file(bad)
    with pytest.raises(ValueError, match="unknown workflow 'tot'"):
        OrchestratorConfig(workflow="tot")
    with pytest.raises(ValueError, match="unknown policy 'judge'"):
        OrchestratorConfig(policy="judge")
    broken = tmp_path / "broken.toml"
    broken.write_text("policy = [")
    with pytest.raises(ValueError, match="not valid TOML"):
        OrchestratorConfig.from_file(broken)
    with pytest.raises(ValueError, match=r"must end in \.yaml"):
        (tmp_path / "c.ini").write_text("x")
        OrchestratorConfig.from_file(tmp_path / "c.ini")


def test_run_and_map_with_a_store_that_resumes(tmp_path):
    small, large = scripted_pair()
    orch = Orchestrator(small, large, LLM_SPECREASON)
    assert orch.run_sync("cot", "What is 17 * 23?").answer == "391"
    store = tmp_path / "runs.jsonl"
    results = orch.map_sync(["q1", ("named", "q2")], store=store)
    assert sorted(r.id for r in results) == ["0", "named"]
    assert orch.map_sync(["q1", ("named", "q2")], store=store) == []  # all done: nothing runs again
    assert len(list(ResultStore(store))) == 2


def test_streaming_events_from_the_sdk():
    small, large = scripted_pair()
    orch = Orchestrator(small, large, LLM_SPECREASON)

    async def collect():
        return [item async for item in orch.stream("cot", "q")]

    items = asyncio.run(collect())
    assert [e.data["text"] for e in items[:-1] if e.kind == "step"] == ["Multiply.\n\n", "So \\boxed{391}."]
    assert items[-1].answer == "391"


def test_an_orchestrator_as_a_node_of_another_graph():
    inner_small, inner_large = scripted_pair()
    expert = Orchestrator(inner_small, inner_large, LLM_SPECREASON)
    g = StepGraph(inputs=["question"], output="report")
    g.add_tool("expert", expert.as_tool("cot"), inputs=["question"])
    g.add_generate("report", "The expert says {expert}. Summarize.", tier="small")
    g.add_sequence(START, "expert", "report", END)
    outer_small = ScriptedModel(outputs=["It is 391."])
    outer = Orchestrator(outer_small, ScriptedModel(), "large")
    result = outer.run_sync(g, "What is 17 * 23?")
    assert result.ok and result.answer == "It is 391."
    assert "The expert says 391. Summarize." in outer_small.generated_prompts()[0]


def test_a_policy_is_a_name_settings_or_an_object_that_starts_runs():
    from thinkahead.step_spec.policies import SpecReason
    from thinkahead.step_spec.state import StepOutcome

    small, large = scripted_pair()
    spec = SpecReason(**LLM_JUDGE, threshold=5)
    orch = Orchestrator(small, large, spec)
    assert orch.runtime.policy is spec and orch.run_sync("cot", "What is 17 * 23?").answer == "391"
    assert Orchestrator(small, large, {"name": "specreason", "threshold": 3}).config.policy.threshold == 3

    class Fixed:  # written before start(ctx): steps as it is, as the step loop allows
        name = "fixed"

        async def next_step(self, ctx):
            return StepOutcome(text="\\boxed{12}", author="small", verdict="baseline")

    assert Orchestrator(small, large, Fixed()).run_sync("cot", "q").answer == "12"
    for wrong in (42, ["specreason"], object()):
        with pytest.raises(ValueError, match=rf"policy must be a policy name, .* got {type(wrong).__name__}"):
            Orchestrator(small, large, wrong)


def test_model_specs_are_checked_before_loading():
    with pytest.raises(ValueError, match="cannot resolve model spec 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="expected openai:MODEL@http"):
        load_model("openai:qwen")
    remote = load_model("openai:qwen@http://127.0.0.1:9/v1", dtype="int8")
    assert type(remote).__name__ == "OpenAIModel" and remote.name == "qwen"
    asyncio.run(remote.aclose())


def test_the_plain_python_agents_example_runs():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "plain_agents.py"
    spec = importlib.util.spec_from_file_location("plain_agents", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def small_out(prompt, request):
        if "Proposed answer" in prompt:
            return "\\boxed{yes}"
        return "\\boxed{391}" if "17 * 23" in prompt else "\\boxed{12}"

    orch = Orchestrator(ScriptedModel(outputs=small_out), ScriptedModel(logprobs=JUDGE_YES), LLM_SPECREASON, concurrency=2)
    rows = asyncio.run(example.team(orch, ["What is 17 * 23?", "What is 144 / 12?"]))
    assert [(r["answer"], r["review"], r["ok"]) for r in rows] == [("391", "yes", True), ("12", "yes", True)]


def test_a_tokenizer_is_only_for_remote_models():
    config = OrchestratorConfig(large={"spec": "sglang:http://127.0.0.1:9", "tokenizer": "qwen2.5-coder-1.5b"})
    assert config.large.options()["tokenizer"] == "qwen2.5-coder-1.5b"
    with pytest.raises(ValueError, match="tokenizer is only for remote"):
        OrchestratorConfig(large={"spec": "qwen2.5-coder-1.5b", "tokenizer": "qwen2.5-coder-1.5b"})


def test_agent_sessions_reach_the_local_suffix_cache(tiny_model_dir):
    from thinkahead.models import LocalModel

    model = LocalModel(str(tiny_model_dir), dtype="float32")
    orch = Orchestrator(model, model, "small", steps={"max_steps": 3, "max_tokens": None},
                        segment={"max_step_tokens": 6})
    cache = model.suffix_cache
    first = orch.run_sync("cot", "w5 w6 w7", session="agent-1")
    assert first.ok
    stats = cache.session_stats
    generations = first.cost["model_calls"]
    assert stats.session_starts == 1  # the chain's first step opened the session ...
    assert stats.session_extends + stats.session_rebuilds == generations - 1  # ... every later call continued it
    assert "agent-1/answer" in cache.sessions  # kept for the agent's next turn
    second = orch.run_sync("cot", "w5 w6 w7 w8 w9", session="agent-1")
    assert second.ok and cache.session_stats.session_starts == 1  # the next turn continued the same session
    orch.run_sync("cot", "w5 w6", id="solo")
    assert "solo/answer" not in cache.sessions and cache.session_stats.sessions_ended == 1  # ended with its run


def test_a_bad_setting_is_one_plain_value_error_naming_the_field():
    """A registry name that does not exist came wrapped in pydantic's 19-line report."""
    from pydantic import ValidationError

    with pytest.raises(ValueError) as info:
        Orchestrator(small="qwen-nosuch", large="qwen2.5-coder-0.5b")
    assert not isinstance(info.value, ValidationError)
    message = str(info.value)
    assert message.startswith("Orchestrator: small.spec: cannot resolve model spec 'qwen-nosuch'") and "\n" not in message
    assert "qwen2.5-coder-0.5b" in message  # the registry names it could have been


def test_a_hub_model_missing_from_the_local_cache_is_refused_at_construction(tmp_path, monkeypatch):
    """`hf:nosuch/model` was accepted, then the first run failed with a 99-line OSError from transformers."""
    from click.testing import CliRunner
    from huggingface_hub import constants

    from thinkahead.cli import main

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    small, large = scripted_pair()
    for spec in ("hf:nosuch/model", "nosuch/model"):
        with pytest.raises(ValueError, match=r"nosuch/model is not in the local Hugging Face cache .*hf download"):
            Orchestrator(small=spec, large=large)
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"question": "q"}\n')
    result = CliRunner().invoke(main, ["run", str(tasks), "-o", str(tmp_path / "r.jsonl"), "--small", "hf:nosuch/model"])
    assert result.exit_code == 2 and "small model: model spec 'hf:nosuch/model'" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "r.jsonl").exists()
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc"  # a model in the cache passes
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached" / "refs" / "main").write_text("abc")
    assert Orchestrator(small="hf:org/cached", large=large).config.small.spec == "hf:org/cached"
    given = Orchestrator(small, large, LLM_SPECREASON, config={"small": "hf:nosuch/model"})
    assert given.small is small  # an instance stands in for the spec
