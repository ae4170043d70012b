"""The pair drafts for itself: a large `LocalModel` with a small one beside it (`draft=`) drafts with it
(`hybrid`), on the small model's scheduler thread; the draft model's forwards run in one batch with the small
model's own work; greedy output stays the plain greedy output; the token stats say who drafted what."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

pytest.importorskip("thinkahead.models.engine.kernels._layer_native")
pytest.importorskip("thinkahead.models.engine.kernels._kquant_native")

from thinkahead.models.engine.weights import gguf_native
from thinkahead.models.base import GenerationRequest
from thinkahead.models.local import LocalModel
from thinkahead.models.engine.runner import HFEngine
from thinkahead.models.engine.scheduler import BatchScheduler
from thinkahead.token_spec.engine import ForwardCall

from tests.test_gguf_native import tiny_config, write_tiny_gguf
from tests.tiny_models import byte_tokenizer


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Two tiny GGUF models with one tokenizer and different weights (the tied one's output layer is its
    embedding table): a target and its draft model."""
    folder = tmp_path_factory.mktemp("pair")
    target, draft = folder / "target.gguf", folder / "draft.gguf"
    write_tiny_gguf(target)
    write_tiny_gguf(draft, tied=True)
    return target, draft


def build(path, name, **options) -> LocalModel:
    return LocalModel(model=gguf_native.build_model(path, tiny_config()), tokenizer=byte_tokenizer(), name=name,
                      **options)


@pytest.fixture(scope="module")
def pair(paths):
    """A draft model with the target's weights (a copy): its drafts hit, so every kind of round happens."""
    small = build(paths[0], "small")
    return small, build(paths[0], "large", draft=small, drafter="hybrid")


QUESTIONS = [f"Q{i}: name {i} things you find in a {['kitchen', 'garden', 'shed', 'car'][i % 4]}." for i in range(6)]


def request(text: str, speculative: bool = True, n: int = 24) -> GenerationRequest:
    return GenerationRequest(prompt=text, max_new_tokens=n, temperature=0, stop=[], speculative=speculative)


def test_auto_is_combined_and_hybrid_shares_the_small_models_thread_and_weights(pair, paths) -> None:
    small, large = pair
    assert (small.drafter, small.draft) == ("combined", None)  # auto: the best model-free drafter
    alone = build(paths[0], "large-auto", draft=small)  # auto with a draft model beside it: still combined
    assert (alone.drafter, alone.draft) == ("combined", None) and alone.scheduler is not small.scheduler
    assert large.drafter == "hybrid" and large.draft is small
    assert large.scheduler.scheduler is small.scheduler  # one thread owns both engines
    assert large._speculative.drafter.model.engine is small.engine  # the small model's weights, not a copy


def test_the_pair_stays_exact_alone_and_together_and_says_who_drafted(pair) -> None:
    small, large = pair
    solo = [large.generate_sync(request(q, speculative=False)).token_ids for q in QUESTIONS]
    alone = large.generate_sync(request(QUESTIONS[0]))
    assert alone.token_ids == solo[0]
    assert alone.spec.model_drafts > 0  # alone, the small model drafted
    assert 0 < alone.spec.model_correct_drafts <= alone.spec.model_drafts
    assert alone.spec.counters()["model_drafts"] == alone.spec.model_drafts
    small_solo = small.generate_sync(request(QUESTIONS[1], speculative=False)).token_ids
    # together: the large model's generations and the small model's own, all on one thread
    futures = [large.scheduler.submit(lambda q=q: large._completion_rounds(large.encode(q), request(q), None))
               for q in QUESTIONS]
    own = small.scheduler.submit(lambda: small._completion_rounds(small.encode(QUESTIONS[1]), request(QUESTIONS[1]),
                                                                  None))
    assert [f.result(timeout=120).token_ids for f in futures] == solo
    assert own.result(timeout=120).token_ids == small_solo


def test_a_draft_models_forward_joins_the_small_models_batch(paths, monkeypatch) -> None:
    """A call that names another engine (a draft model's) runs in that engine's forward of the step, with that
    engine's own work, before the verifies; each result is the forward alone's."""
    draft_engine = HFEngine(gguf_native.build_model(paths[1], tiny_config()))
    target_engine = HFEngine(gguf_native.build_model(paths[0], tiny_config()))
    scheduler = BatchScheduler(draft_engine)
    lane = scheduler.lane(target_engine)
    sizes: list[tuple[str, int]] = []
    for label, engine in (("draft", draft_engine), ("target", target_engine)):
        real = engine.forward_batch
        monkeypatch.setattr(engine, "forward_batch",
                            lambda calls, real=real, label=label: sizes.append((label, len(calls))) or real(calls))
    tokens = [5, 9, 14, 3, 22, 7]

    def drafting():  # a target generation that asks the draft model first, then verifies
        drafted = yield ForwardCall(draft_engine.new_session(), tokens, last_only=True, engine=draft_engine)
        verified = yield ForwardCall(target_engine.new_session(), tokens)
        return drafted, verified

    def own():  # the draft model's own generation
        return (yield ForwardCall(draft_engine.new_session(), tokens[:4]))

    gate: Future = Future()
    holding = threading.Event()
    # holds the thread until both are queued (waiting until it holds: a thread that had not yet admitted the gate
    # could admit it with the first and step before the second is queued)
    scheduler.submit(lambda: holding.set() or gate.result(timeout=30))
    assert holding.wait(timeout=30)
    first, second = lane.submit(drafting), scheduler.submit(own)
    gate.set_result(None)
    drafted, verified = first.result(timeout=60)
    mine = second.result(timeout=60)
    assert sizes == [("draft", 2), ("target", 1)]
    assert drafted.equal(draft_engine.forward(draft_engine.new_session(), tokens, last_only=True))
    assert verified.equal(target_engine.forward(target_engine.new_session(), tokens))
    assert mine.equal(draft_engine.forward(draft_engine.new_session(), tokens[:4]))
    scheduler.close()


def test_a_draft_model_with_another_tokenizer(paths) -> None:
    small = build(paths[1], "small")
    other = byte_tokenizer()
    other.add_tokens(["<extra>"])
    large = LocalModel(model=gguf_native.build_model(paths[0], tiny_config()), tokenizer=other, name="large",
                       draft=small)
    assert (large.drafter, large.draft) == ("combined", None)  # auto drafts model-free: no tokenizer needed
    assert large.scheduler is not small.scheduler
    with pytest.raises(ValueError, match="does not share large's tokenizer"):
        LocalModel(model=gguf_native.build_model(paths[0], tiny_config()), tokenizer=other, name="large",
                   draft=small, drafter="hybrid")
    with pytest.raises(ValueError, match="needs a draft model"):
        LocalModel(model=gguf_native.build_model(paths[0], tiny_config()), tokenizer=byte_tokenizer(),
                   drafter="draft-model")
    with pytest.raises(ValueError, match="draft must be a LocalModel"):
        LocalModel(model=gguf_native.build_model(paths[0], tiny_config()), tokenizer=byte_tokenizer(), draft="small")


def test_a_pair_that_does_not_draft_together_still_runs_on_one_thread_and_each_answers_as_alone(paths) -> None:
    import asyncio

    small = build(paths[1], "small-own")
    large = build(paths[0], "large-guest", thread_of=small)  # as load_pair builds a local pair
    assert large.drafter == "combined" and large.draft is None
    assert large.scheduler.scheduler is small.scheduler  # one thread, one OpenMP team (engine/threads.py)
    apart = build(paths[0], "large-apart", prefill_chunk=32, thread_of=small)  # other batching: a thread of its own
    assert isinstance(apart.scheduler, BatchScheduler)
    want_large = [build(paths[0], "ref-large").generate_sync(request(q)).token_ids for q in QUESTIONS[:3]]
    want_small = [build(paths[1], "ref-small").generate_sync(request(q)).token_ids for q in QUESTIONS[3:]]

    async def together():
        return await asyncio.gather(*(large.generate(request(q)) for q in QUESTIONS[:3]),
                                    *(small.generate(request(q)) for q in QUESTIONS[3:]))

    got = [c.token_ids for c in asyncio.run(together())]
    assert got == want_large + want_small
    with pytest.raises(ValueError, match="thread_of must be a LocalModel"):
        build(paths[0], "bad", thread_of="small")


def test_load_pair_puts_a_local_large_model_on_the_small_ones_thread(paths, monkeypatch) -> None:
    from thinkahead.models import loader

    small, calls = build(paths[1], "small-host"), []

    def load_model(spec, **options):
        calls.append((spec, options))
        return spec if isinstance(spec, LocalModel) else None

    monkeypatch.setattr(loader, "load_model", load_model)
    loader.load_pair(small, "qwen2.5-coder-1.5b", {}, {})
    loader.load_pair(small, "qwen2.5-coder-1.5b", {}, {"drafter": "hybrid"})
    loader.load_pair(small, "openai:m@http://127.0.0.1:9/v1", {}, {})
    assert [options for spec, options in calls if spec != small] == [
        {"thread_of": small}, {"drafter": "hybrid", "draft": small}, {}]
