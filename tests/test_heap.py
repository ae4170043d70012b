"""The garbage collector around model loads (thinkahead/models/engine/heap.py): paused while a load runs,
one collection after it, what survived frozen, and the process's own setting kept."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from thinkahead.models.engine import heap


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_load_pauses_the_collector_then_collects_and_freezes_what_lives() -> None:
    frozen = gc.get_freeze_count()
    with heap.loading():
        assert not gc.isenabled()
        kept = [_Cycle() for _ in range(100)]  # what the load made that lives on
        garbage = _Cycle()
        dead = weakref.ref(garbage)
        del garbage  # a cycle the load made and dropped: collected at its end, not frozen
        assert dead() is not None  # not while the collector is paused
    assert gc.isenabled()
    assert dead() is None
    assert gc.get_freeze_count() >= frozen + len(kept)
    live = {id(o) for o in gc.get_objects()}  # the generations later collections walk
    assert not any(id(k) in live for k in kept)


def test_a_process_that_turned_the_collector_off_keeps_it_off() -> None:
    gc.disable()
    with heap.loading():
        pass
    assert not gc.isenabled()


def test_a_failed_load_still_restores_the_collector() -> None:
    with pytest.raises(RuntimeError, match="broken"):
        with heap.loading():
            raise RuntimeError("broken file")
    assert gc.isenabled()


def test_loads_on_two_threads_share_one_pause() -> None:
    first_in, second_done, seen = threading.Event(), threading.Event(), []

    def first() -> None:
        with heap.loading():
            first_in.set()
            second_done.wait(10)
            seen.append(("first, after the second ended", gc.isenabled()))

    def second() -> None:
        first_in.wait(10)
        with heap.loading():
            seen.append(("second", gc.isenabled()))
        second_done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == [("second", False), ("first, after the second ended", False)]
    assert gc.isenabled()


def test_loading_a_model_leaves_the_collector_on_and_the_model_frozen(tiny_model_dir) -> None:
    from thinkahead.models.engine.weights.load import load_causal_lm

    frozen = gc.get_freeze_count()
    model, _ = load_causal_lm(str(tiny_model_dir), dtype="float32", weight_cache=False)
    assert gc.isenabled()
    assert gc.get_freeze_count() > frozen
    assert all(o is not model for o in gc.get_objects())  # frozen: later collections do not walk it
