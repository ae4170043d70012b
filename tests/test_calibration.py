"""A forward's cost curve is measured once per machine and model, kept beside the weight cache, and read back by
the next process; a damaged store is measured over, never trusted; reading it never changes it."""

from __future__ import annotations

import json
import logging

import pytest

from thinkahead.models.engine import calibration

from tests.test_batching import engine, gguf_path  # noqa: F401 (fixtures)
from tests.test_goodput import three_together
from tests.test_gguf_native import tiny_config, tiny_gguf  # noqa: F401 (fixture)

CURVE = {0: 0.02, 1: 0.021, 7: 0.05, 15: 0.06}


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("THINKAHEAD_HOME", str(tmp_path))
    monkeypatch.delenv("THINKAHEAD_WEIGHT_CACHE", raising=False)
    return calibration.store_path()


@pytest.fixture
def measured(monkeypatch):
    calls = []
    monkeypatch.setattr("thinkahead.models.engine.scheduler.measure_rows", lambda e: calls.append(e) or dict(CURVE))
    return calls


def test_a_named_engine_is_measured_once_and_the_next_process_reads_its_curve(engine, store, measured,
                                                                              monkeypatch) -> None:
    monkeypatch.setattr(engine, "calibration_key", "tiny|gguf|2 threads|this cpu", raising=False)
    first = three_together(engine, "suffix", 12)
    assert measured == [engine] and first.cost.calibrated
    kept = store.read_bytes()
    assert json.loads(kept)["curves"]["tiny|gguf|2 threads|this cpu"]["rows"] == {str(k): v for k, v in CURVE.items()}
    before = store.stat().st_mtime_ns
    second = three_together(engine, "suffix", 12)  # a new scheduler: as a new process would build it
    assert measured == [engine] and second.cost.calibrated  # read, not measured again
    assert second.cost(15) / second.cost(0) == pytest.approx(CURVE[15] / CURVE[0])  # the stored shape
    assert store.read_bytes() == kept and store.stat().st_mtime_ns == before  # reading changed nothing


def test_another_key_is_measured_and_kept_beside_the_first(engine, store, measured, monkeypatch) -> None:
    calibration.save("other model", {0: 1.0, 3: 2.0}, store)
    monkeypatch.setattr(engine, "calibration_key", "tiny", raising=False)
    three_together(engine, "suffix", 12)
    assert measured == [engine]
    assert set(json.loads(store.read_text())["curves"]) == {"other model", "tiny"}


@pytest.mark.parametrize("damage", ["{not json",
                                    '{"format": 1, "curves": {"tiny": {"rows": {"0": 1.0}}}}' + " " * calibration.MAX_STORE_BYTES, '{"format": 99, "curves": {}}', '[1, 2]',
                                    '{"format": 1, "curves": {"tiny": {"rows": {"0": -1.0}}}}',
                                    '{"format": 1, "curves": {"tiny": {"rows": {"x": 1.0}}}}',
                                    '{"format": 1, "curves": {"tiny": {"rows": {"0": NaN}}}}',
                                    '{"format": 1, "curves": {"tiny": {"rows": {"0": true}}}}'])
def test_a_damaged_store_is_measured_over_and_replaced(engine, store, measured, monkeypatch, caplog, damage) -> None:
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(damage)
    monkeypatch.setattr(engine, "calibration_key", "tiny", raising=False)
    with caplog.at_level(logging.WARNING):
        scheduler = three_together(engine, "suffix", 12)
    assert measured == [engine] and scheduler.cost.calibrated
    assert "ignoring" in caplog.text
    assert calibration.load("tiny", store) == CURVE  # the next process reads a sound curve


def test_an_engine_without_a_key_or_with_the_cache_off_keeps_nothing(engine, store, measured, monkeypatch) -> None:
    three_together(engine, "suffix", 12)  # built from a model object: no key
    assert measured == [engine] and not store.exists()
    monkeypatch.setattr(engine, "calibration_key", "tiny", raising=False)
    monkeypatch.setenv("THINKAHEAD_WEIGHT_CACHE", "0")
    three_together(engine, "suffix", 12)
    assert len(measured) == 2 and not store.exists()


def test_a_store_that_cannot_be_written_costs_a_warning_not_the_run(engine, tmp_path, measured, monkeypatch,
                                                                    caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("THINKAHEAD_HOME", str(blocker))  # its weight-cache folder cannot be made
    monkeypatch.delenv("THINKAHEAD_WEIGHT_CACHE", raising=False)
    monkeypatch.setattr(engine, "calibration_key", "tiny", raising=False)
    with caplog.at_level(logging.WARNING):
        scheduler = three_together(engine, "suffix", 12)
    assert scheduler.cost.calibrated and "could not keep" in caplog.text


def test_the_key_names_the_model_dtype_threads_cpu_and_kernels() -> None:
    key = calibration.engine_key("qwen2.5-coder-1.5b", "gguf", 2)
    assert key.startswith("qwen2.5-coder-1.5b|gguf|2 threads|") and len(key.split("|")) == 7
    assert calibration.engine_key("qwen2.5-coder-1.5b", "gguf", 1) != key


def test_a_curve_measured_under_other_load_serves_its_process_but_is_not_kept(engine, store, monkeypatch,
                                                                              caplog) -> None:
    noisy = {0: 0.59, 1: 1.09, 3: 1.10, 15: 0.27, 31: 0.47}  # seen while another job ran: 16 rows cheaper than 1
    monkeypatch.setattr("thinkahead.models.engine.scheduler.measure_rows", lambda e: dict(noisy))
    monkeypatch.setattr(engine, "calibration_key", "tiny", raising=False)
    with caplog.at_level(logging.WARNING):
        scheduler = three_together(engine, "suffix", 12)
    assert scheduler.cost.calibrated and "not keeping" in caplog.text
    assert calibration.load("tiny", store) is None
    assert calibration.plausible(CURVE) and not calibration.plausible(noisy)


def test_calibrate_measures_before_any_work_and_refuses_once_work_runs(engine, store, measured, monkeypatch) -> None:
    """`calibrate()` (a named LocalModel calls it at load) measures in the caller's thread, while nothing else runs;
    the first batch then reads the curve instead of timing forwards among its own requests' work."""
    from thinkahead.models.engine.scheduler import BatchScheduler

    monkeypatch.setattr(engine, "calibration_key", "tiny", raising=False)
    scheduler = BatchScheduler(engine, name="tiny")
    scheduler.calibrate()
    assert measured == [engine] and scheduler.cost.calibrated and scheduler.steps == 0
    assert calibration.load("tiny", store) == CURVE
    scheduler.run(lambda: 7)  # the scheduler's thread starts with work
    with pytest.raises(RuntimeError, match="before any work"):
        scheduler.calibrate()
    scheduler.close()
