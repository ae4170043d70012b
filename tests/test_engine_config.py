"""`EngineConfig`: a local model's engine settings in one place, read by `LocalModel`, config files and the CLI;
a setting that cannot be honoured is refused by name."""

from __future__ import annotations

import pytest

from thinkahead.config import ENGINE_NEUTRAL, ModelConfig, OrchestratorConfig
from thinkahead.models.engine.config import ENGINE_SETTINGS, EngineConfig
from thinkahead.models.loader import load_pair
from thinkahead.token_spec.names import MAX_BATCH_ROWS, PREFILL_CHUNK

from tests.test_pair_drafting import build, paths  # noqa: F401 - fixture

REMOTE = "openai:qwen@http://127.0.0.1:9/v1"  # built without connecting


def test_local_model_runs_as_its_engine_config_says(paths) -> None:
    model = build(paths[0], "m", engine=EngineConfig(max_batch_rows=48), prefill_chunk=16, kv_live_tokens=900,
                  kv_sessions=3)
    assert model.config == EngineConfig(max_batch_rows=48, prefill_chunk=16, kv_live_tokens=900, kv_sessions=3)
    assert (model.scheduler.max_rows, model.scheduler.prefill_chunk) == (48, 16)
    assert model.scheduler._main.max_tokens == 900 and model.prefix_pool.max_sessions == 3
    default = build(paths[0], "d")
    assert (default.scheduler.max_rows, default.scheduler.prefill_chunk) == (MAX_BATCH_ROWS, PREFILL_CHUNK)
    assert default.config == EngineConfig()


@pytest.mark.parametrize("settings, named", [
    ({"max_batch_row": 8}, "unknown engine setting(s) max_batch_row"),
    ({"prefill_chunk": 0}, "prefill_chunk: Input should be greater than 0"),
    ({"dtype": "fp8"}, "unknown dtype 'fp8'"),
    ({"drafter": "magic"}, "unknown drafter 'magic'"),
])
def test_a_bad_engine_setting_is_refused_by_name_before_any_weights_load(settings, named) -> None:
    with pytest.raises(ValueError) as exc:
        EngineConfig.of(**settings)
    assert named in str(exc.value)
    from thinkahead.models.local import LocalModel

    with pytest.raises(ValueError) as exc:  # a spec that would load real weights: refused first
        LocalModel("qwen2.5-coder-1.5b", **settings)
    assert named in str(exc.value)


def test_a_pair_that_shares_a_scheduler_must_batch_alike(paths) -> None:
    small = build(paths[1], "small", max_batch_rows=64)
    with pytest.raises(ValueError, match="max_batch_rows 512 against 64 cannot both hold"):
        build(paths[0], "large", draft=small, drafter="hybrid")
    large = build(paths[0], "large", draft=small, drafter="hybrid", max_batch_rows=64)
    assert large.scheduler.scheduler is small.scheduler


def test_a_config_files_engine_settings_reach_the_model_and_a_remote_model_refuses_them(paths) -> None:
    config = OrchestratorConfig.model_validate({"large": {"spec": "qwen2.5-coder-1.5b", "kv_live_tokens": 4000,
                                                          "prefill_chunk": 32}})
    options = config.large.options()
    assert set(options) >= set(ENGINE_SETTINGS)
    assert (options["kv_live_tokens"], options["prefill_chunk"], options["max_batch_rows"]) == (4000, 32, MAX_BATCH_ROWS)
    with pytest.raises(ValueError, match="kv_live_tokens, prefill_chunk are only for local models"):
        ModelConfig(spec=REMOTE, kv_live_tokens=4000, prefill_chunk=32)
    with pytest.raises(ValueError, match="drafter is only for local models"):
        ModelConfig(spec=REMOTE, drafter="suffix")
    assert ModelConfig(spec=REMOTE, dtype="int8").dtype == "int8"  # --dtype applies to both models of a command
    # the loader drops every engine setting for a remote model (its server runs as it was started)
    small = build(paths[1], "small")
    _, remote = load_pair(small, REMOTE, large_options=ModelConfig(spec=REMOTE).options())
    assert remote.client.base_url == "http://127.0.0.1:9/v1"


def test_engine_settings_may_change_between_resumes_and_older_stores_resume(tmp_path) -> None:
    # stores written before the engine's memory and batching settings were settings lack them; and they move no
    # token, so a resume with other values (more KV room, other prefill pieces) goes on
    from thinkahead.orchestrator.store import ResultStore

    before = OrchestratorConfig().store_identity()
    assert "prefill_chunk" not in before["large"] and "max_batch_rows" not in before["small"]
    path = tmp_path / "runs.jsonl"

    def resume(identity) -> None:
        store = ResultStore(path, config=identity)
        try:
            store.open_for_append()
        finally:
            store.close()

    resume({**before, "small": {k: v for k, v in before["small"].items() if k not in ENGINE_NEUTRAL},
            "large": {k: v for k, v in before["large"].items() if k not in ENGINE_NEUTRAL}})  # an older store
    later = OrchestratorConfig.model_validate({"large": {"spec": "qwen2.5-coder-1.5b", "prefill_chunk": 32,
                                                         "kv_live_tokens": 5000}})
    resume(later.store_identity())
    other = OrchestratorConfig.model_validate({"large": {"spec": "qwen2.5-coder-1.5b", "max_draft": 8}})
    with pytest.raises(Exception, match="max_draft"):  # what does move tokens still must match
        resume(other.store_identity())


def test_a_config_whose_pair_cannot_share_a_scheduler_is_refused_before_any_model_loads() -> None:
    with pytest.raises(ValueError, match="prefill_chunk 32 against 64 cannot both hold"):
        OrchestratorConfig.model_validate({"large": {"spec": "qwen2.5-coder-1.5b", "drafter": "hybrid",
                                                     "prefill_chunk": 32}})
    fine = OrchestratorConfig.model_validate({"large": {"spec": "qwen2.5-coder-1.5b", "prefill_chunk": 32}})
    assert fine.large.prefill_chunk == 32  # a model-free drafter: each model its own scheduler


def test_a_model_config_is_an_engine_config() -> None:
    config = ModelConfig(spec="qwen2.5-coder-0.5b", kv_live_tokens=700, record="/tmp/r.jsonl")
    assert EngineConfig.of(config) == EngineConfig(kv_live_tokens=700)
