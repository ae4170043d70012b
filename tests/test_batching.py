"""Many generations at once (thinkahead/models/engine/scheduler.py, `LocalModel`'s scheduler): each sequence's greedy tokens
equal its solo plain greedy tokens whatever joins or leaves the batch and whatever its drafter; sampling stays
exact per seed; a long prompt is prefilled in chunks; a failing or cancelled generation leaves the others alone."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import Future

import pytest
import torch

pytest.importorskip("thinkahead.models.engine.kernels._layer_native")
pytest.importorskip("thinkahead.models.engine.kernels._kquant_native")

from thinkahead.models.engine.weights import gguf_native
from thinkahead.models.base import GenerationRequest
from thinkahead.models.local import LocalModel
from thinkahead.models.engine.runner import HFEngine
from thinkahead.models.engine.goodput import allocate
from thinkahead.models.engine.scheduler import BatchScheduler
from thinkahead.token_spec.decoder import plain_greedy
from thinkahead.token_spec.presets import build_decoder
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.verify import SamplingParams

from tests.test_gguf_native import tiny_config, tiny_gguf  # noqa: F401 (fixture)
from tests.tiny_models import VOCAB, byte_tokenizer

DRAFTERS = ("none", "suffix", "prompt-lookup", "suffix-tree", "combined")


@pytest.fixture(scope="module")
def gguf_path(tiny_gguf):
    return tiny_gguf[0]


@pytest.fixture(scope="module")
def engine(gguf_path):
    engine = HFEngine(gguf_native.build_model(gguf_path, tiny_config()))
    assert engine.batches_rows
    return engine


def prompt(seed: int, n: int) -> list[int]:
    """A prompt with repeats in it (prompt lookup and the suffix cache find drafts)."""
    motif = [(seed * 11 + 5 * i) % (VOCAB - 3) + 3 for i in range(7)]
    return (motif * (n // 7 + 1))[:n]


def wait_for_steps(scheduler: BatchScheduler, steps: int) -> None:
    deadline = time.monotonic() + 30
    while scheduler.steps < steps and time.monotonic() < deadline:
        time.sleep(0.001)


def counting(engine, monkeypatch) -> list[int]:
    """Records the number of calls in every `forward_batch`."""
    sizes: list[int] = []
    real = engine.forward_batch
    monkeypatch.setattr(engine, "forward_batch", lambda calls, *a: sizes.append(len(calls)) or real(calls, *a))
    return sizes


def test_eight_sequences_with_mixed_drafters_joining_and_leaving_equal_their_solo_plain_greedy(engine, monkeypatch):
    cache = SuffixCache()
    decoders = {kind: build_decoder(kind, engine, cache=cache) for kind in DRAFTERS}
    jobs = [(prompt(s, 12 + 9 * s), 20 + 7 * (s % 3), DRAFTERS[s % len(DRAFTERS)]) for s in range(8)]
    expected = [plain_greedy(engine, p, n) for p, n, _ in jobs]
    for (p, n, kind), want in zip(jobs[:4], expected):  # earlier outputs in the suffix cache: drafts that hit
        assert decoders[kind].generate(p, n, stop_token_ids=[]).token_ids == want
    sizes = counting(engine, monkeypatch)
    scheduler = BatchScheduler(engine, prefill_chunk=8)

    def start(i: int):
        p, n, kind = jobs[i]
        return decoders[kind].rounds(p, n, stop_token_ids=[], share=scheduler.share())

    futures = [scheduler.submit(lambda i=i: start(i)) for i in range(5)]
    wait_for_steps(scheduler, 3)  # the last three join while the first five are decoding
    late = [scheduler.submit(lambda i=i: start(i)) for i in range(5, 8)]
    results = [f.result(timeout=60) for f in futures + late]
    scheduler.close()
    assert [r.token_ids for r in results] == expected
    assert max(sizes) >= 5 and scheduler.peak_batch >= 5  # they really ran together
    assert sum(r.stats.spec_num_correct_drafts for r in results) > 0  # and speculated


def test_sampling_with_a_seed_is_the_same_in_a_batch_as_alone(engine) -> None:
    # token for token where the drafts are the same (here: none); with drafts, which sample a seed gives depends
    # on them (rejection sampling), and what stays exact is the distribution (tests/test_sampling_is_lossless.py)
    decoder = build_decoder("none", engine)
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    jobs = [(prompt(s, 15), 24, 100 + s) for s in range(4)]
    alone = [decoder.generate(p, n, sampling=sampling, stop_token_ids=[], seed=seed).token_ids for p, n, seed in jobs]
    scheduler = BatchScheduler(engine)
    futures = [scheduler.submit(lambda p=p, n=n, seed=seed: decoder.rounds(p, n, sampling, [], seed,
                                                                            share=scheduler.share()))
               for p, n, seed in jobs]
    assert [f.result(timeout=60).token_ids for f in futures] == alone
    scheduler.close()


def test_a_failing_generation_fails_alone_and_a_closed_scheduler_refuses_work(engine) -> None:
    decoder = build_decoder("none", engine)
    scheduler = BatchScheduler(engine)
    good = [prompt(s, 10) for s in range(3)]
    futures = [scheduler.submit(lambda p=p: decoder.rounds(p, 12, stop_token_ids=[])) for p in good]
    bad = scheduler.submit(lambda: decoder.rounds([3, VOCAB + 7, 4], 12, stop_token_ids=[]))
    with pytest.raises(ValueError, match="not a token id"):
        bad.result(timeout=60)
    assert [f.result(timeout=60).token_ids for f in futures] == [plain_greedy(engine, p, 12) for p in good]
    scheduler.close()
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.submit(lambda: 1)


@pytest.fixture(scope="module")
def model(gguf_path):
    model = LocalModel(model=gguf_native.build_model(gguf_path, tiny_config()), tokenizer=byte_tokenizer(),
                       drafter="suffix", name="tiny-gguf")
    assert model.engine.batches_rows
    return model


QUESTIONS = [f"Question {i}: what is {i} + {2 * i}? Say it twice: {i} {i}." for i in range(8)]


def test_local_model_serves_concurrent_requests_in_one_batch_exactly(model, monkeypatch) -> None:
    requests = [GenerationRequest(prompt=q, max_new_tokens=16 + 3 * i, temperature=0, stop=[])
                for i, q in enumerate(QUESTIONS)]
    alone = [model.generate_sync(r) for r in requests]
    model.suffix_cache.clear()
    sizes = counting(model.engine, monkeypatch)

    async def together():
        gens = [model.generate(r) for r in requests[:6]]
        streams = [_collect(model.stream(r)) for r in requests[6:]]
        scores = model.next_token_logprobs(QUESTIONS[0], 3)
        return await asyncio.gather(*gens, *streams, scores)

    *got, top = asyncio.run(together())
    assert [c.token_ids for c in got[:6]] == [c.token_ids for c in alone[:6]]
    assert [c.text for c in got[:6]] == [c.text for c in alone[:6]]
    assert got[6:] == [c.text for c in alone[6:]]  # the streams' pieces join to the same texts
    assert top == model.next_token_logprobs_sync(QUESTIONS[0], 3)
    assert max(sizes) >= 4


async def _collect(stream) -> str:
    pieces = []
    async for item in stream:
        if hasattr(item, "finish_reason"):
            return "".join(pieces)
        pieces.append(item.text)
    raise AssertionError("the stream ended without its completion")


def test_a_cancelled_request_leaves_the_batch_and_the_others_finish_exactly(model) -> None:
    long = GenerationRequest(prompt=QUESTIONS[1], max_new_tokens=400, temperature=0, stop=[])
    short = [GenerationRequest(prompt=q, max_new_tokens=20, temperature=0, stop=[]) for q in QUESTIONS[2:5]]
    alone = [model.generate_sync(r).token_ids for r in short]

    async def run():
        doomed = asyncio.ensure_future(model.generate(long))
        others = [asyncio.ensure_future(model.generate(r)) for r in short]
        await asyncio.sleep(0.05)
        doomed.cancel()
        done = await asyncio.gather(*others)
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return done

    assert [c.token_ids for c in asyncio.run(run())] == alone
    deadline = time.monotonic() + 2
    while model.scheduler.live and time.monotonic() < deadline:
        time.sleep(0.01)
    assert model.scheduler.live == 0


def test_goodput_allocation_speculates_where_drafts_hit_and_backs_off_as_the_batch_fills() -> None:
    def curve(k: int) -> float:  # the 1.5B's verify curve (docs/results/verify_curve_gguf.md): 8 rows 1.6x one
        rows = k + 1
        return 1 + 0.087 * (rows - 1) if rows <= 8 else 1.61 + 0.128 * (rows - 8)

    one = allocate([0.8], curve)[0]
    assert 4 <= one <= 16  # alone, a good drafter drafts deeply
    eight = allocate([0.8] * 8, curve)
    assert max(eight) < one and sum(eight) < 8 * one  # in a full batch each drafts less
    mixed = allocate([0.95, 0.1, 0.1, 0.1], curve)
    assert mixed[0] > 0 and mixed[1:] == [0, 0, 0]  # the drafts go where they hit
    assert allocate([0.0] * 4, curve) == [0] * 4 and allocate([], curve) == []
    flat = allocate([0.99], lambda k: 1.0, most=64)  # rows for free: as long as allowed
    assert flat == [64]


def test_a_long_prompt_joins_in_pieces_while_others_decode_and_every_output_is_exact(engine, monkeypatch) -> None:
    decoder = build_decoder("none", engine)
    short = [prompt(s, 6) for s in range(3)]
    long = prompt(9, 150)
    expected = [plain_greedy(engine, p, 30) for p in short] + [plain_greedy(engine, long, 5)]
    sizes: list[list[int]] = []
    real = engine.forward_batch
    monkeypatch.setattr(engine, "forward_batch", lambda calls: sizes.append([len(c.token_ids) for c in calls])
                        or real(calls))
    scheduler = BatchScheduler(engine, prefill_chunk=16)
    futures = [scheduler.submit(lambda p=p: decoder.rounds(p, 30, stop_token_ids=[], share=scheduler.share()))
               for p in short]
    wait_for_steps(scheduler, 3)
    futures.append(scheduler.submit(lambda: decoder.rounds(long, 5, stop_token_ids=[], share=scheduler.share())))
    assert [f.result(timeout=60).token_ids for f in futures] == expected
    scheduler.close()
    pieces = [n for step in sizes for n in step if n > 1]
    # the long prompt: in pieces beside the decoders, its last two chunks' worth (21 tokens) at once
    assert pieces[-9:] == [16] * 8 + [149 - 8 * 16]


def test_a_prompt_of_up_to_two_chunks_is_read_whole_in_one_step_beside_decoders(engine, monkeypatch) -> None:
    # cut at 16, a 20-token prompt waits a whole step for its last 4 tokens (bench/long_prompt_join.py: 4 GSM8K
    # prompts of 65-96 tokens joining 16 decoding streams, read in pieces of 64, the last first token after 3.08 s)
    from thinkahead.models.engine.scheduler import WHOLE_PROMPT_CHUNKS

    decoder = build_decoder("none", engine)
    decoding = [prompt(s, 6) for s in range(2)]
    joiners = [prompt(20 + s, 16 * WHOLE_PROMPT_CHUNKS - 8 + s) for s in range(3)] + [prompt(30, 40)]
    expected = [plain_greedy(engine, p, 40) for p in decoding] + [plain_greedy(engine, p, 3) for p in joiners]
    sizes: list[list[int]] = []
    real = engine.forward_batch
    monkeypatch.setattr(engine, "forward_batch",
                        lambda calls: sizes.append([len(c.token_ids) for c in calls if c.last_only]) or real(calls))
    scheduler = BatchScheduler(engine, prefill_chunk=16)
    futures = [scheduler.submit(lambda p=p: decoder.rounds(p, 40, stop_token_ids=[], share=scheduler.share()))
               for p in decoding]
    wait_for_steps(scheduler, 3)
    futures += [scheduler.submit(lambda p=p: decoder.rounds(p, 3, stop_token_ids=[], share=scheduler.share()))
                for p in joiners]
    assert [f.result(timeout=60).token_ids for f in futures] == expected
    scheduler.close()
    pieces = [n for step in sizes[3:] for n in step]
    # each short one whole; the longer one: a piece, then the rest
    assert [n for n in pieces if n >= 16] == [23, 24, 25, 16, 23]




def test_a_short_prompt_joining_beside_a_long_one_is_read_first_and_the_long_one_still_moves(engine, monkeypatch):
    # the long prompt joins first; read in arrival order, the short ones waited for all of it (bench/long_prompt_join.py:
    # 0.5 s to a first token alone, 4.7 s beside a 1k-token prompt); now the shortest goes first, and a prompt passed
    # over PREFILL_PATIENCE steps takes a piece
    from thinkahead.models.engine.scheduler import PREFILL_PATIENCE

    decoder = build_decoder("none", engine)
    decoding = [prompt(s, 6) for s in range(2)]
    long, shorts = prompt(9, 150), [prompt(20 + s, 12) for s in range(PREFILL_PATIENCE + 2)]
    expected = [plain_greedy(engine, p, 60) for p in decoding] + [plain_greedy(engine, p, 3) for p in [long, *shorts]]
    steps: list[list[str]] = []  # per step, whose prompt each prefill piece is ("long" or "short")
    real = engine.forward_batch
    go, waiting = threading.Event(), threading.Event()
    go.set()

    def forward(calls):
        if not go.is_set():
            waiting.set()
            go.wait(30)
        steps.append(["long" if any(long[i:i + len(c.token_ids)] == list(c.token_ids) for i in range(len(long)))
                      else "short" for c in calls if c.last_only])
        return real(calls)

    monkeypatch.setattr(engine, "forward_batch", forward)
    scheduler = BatchScheduler(engine, prefill_chunk=12)
    futures = [scheduler.submit(lambda p=p: decoder.rounds(p, 60, stop_token_ids=[], share=scheduler.share()))
               for p in decoding]
    wait_for_steps(scheduler, 3)
    go.clear()
    assert waiting.wait(30)  # the scheduler is inside a step: what is submitted now joins in the next one
    joined = len(steps) + 1
    futures += [scheduler.submit(lambda p=p: decoder.rounds(p, 3, stop_token_ids=[], share=scheduler.share()))
                for p in [long, *shorts]]  # the long prompt first
    go.set()
    assert [f.result(timeout=60).token_ids for f in futures] == expected
    scheduler.close()
    pieces = steps[joined:]
    assert pieces[0][0] == "short"  # the shortest first, though the long prompt came first
    first_long = next(i for i, step in enumerate(pieces) if "long" in step)
    assert 0 < first_long <= PREFILL_PATIENCE + 1  # it waited, but no longer than its patience
    last_short = max(i for i, step in enumerate(pieces) if "short" in step)
    last_long = max(i for i, step in enumerate(pieces) if "long" in step)
    assert last_short < last_long  # every short prompt was read before the long one was done


@pytest.mark.slow
def test_the_real_05b_serves_eight_concurrent_prompts_with_mixed_drafters_exactly() -> None:
    """Qwen2.5-Coder-0.5B Q4_K_M (dtype gguf): 8 different chat prompts at once, half through the suffix drafter
    (the suffix cache holding earlier outputs, so drafts hit, and the goodput plan drafts for them) and half plain,
    three joining late; each reply's tokens equal its solo plain greedy tokens."""
    model = LocalModel("qwen2.5-coder-0.5b", dtype="gguf", drafter="suffix", name="real-0.5b")
    assert model.engine.batches_rows
    topics = ["a binary search", "a stack", "a queue", "merge sort", "a linked list", "quick sort", "a hash map",
              "a heap"]
    requests = [GenerationRequest(messages=[{"role": "user", "content": f"Write a Python class for {t}, briefly."}],
                max_new_tokens=40, temperature=0, speculative=i % 2 == 0) for i, t in enumerate(topics)]
    alone = [model.generate_sync(dataclasses.replace(r, speculative=False)) for r in requests]
    for _ in range(2):  # the suffix cache learns the replies; then the engine's sequences have shown that drafts hit
        for r in requests[::2]:
            model.generate_sync(r)
    sizes = counting(model.engine, pytest.MonkeyPatch())

    async def together():
        first = [asyncio.ensure_future(model.generate(r)) for r in requests[:5]]
        await asyncio.sleep(0.3)
        return await asyncio.gather(*first, *(model.generate(r) for r in requests[5:]))

    got = asyncio.run(together())
    assert [c.token_ids for c in got] == [c.token_ids for c in alone]
    assert max(sizes) >= 5
    assert sum(c.spec.spec_num_correct_drafts for c in got if c.spec) > 0


def test_a_fault_of_a_step_fails_its_generations_and_the_scheduler_goes_on(engine, monkeypatch) -> None:
    decoder = build_decoder("none", engine)
    scheduler = BatchScheduler(engine)
    real = scheduler.step
    faults = [RuntimeError("scheduler bug")]

    def step():
        if faults:
            raise faults.pop()
        real()

    monkeypatch.setattr(scheduler, "step", step)
    doomed = scheduler.submit(lambda: decoder.rounds(prompt(1, 8), 5, stop_token_ids=[]))
    with pytest.raises(RuntimeError, match="scheduler bug"):
        doomed.result(timeout=30)
    after = scheduler.submit(lambda: decoder.rounds(prompt(2, 8), 5, stop_token_ids=[]))
    assert after.result(timeout=30).token_ids == plain_greedy(engine, prompt(2, 8), 5)
    scheduler.close()


def test_max_batch_one_runs_one_sequence_per_forward_oldest_first_with_the_same_tokens(engine, monkeypatch) -> None:
    decoder = build_decoder("none", engine)
    sizes = counting(engine, monkeypatch)
    scheduler = BatchScheduler(engine, max_batch=1)
    prompts = [prompt(s, 9) for s in range(3)]
    futures = [scheduler.submit(lambda p=p: decoder.rounds(p, 6, stop_token_ids=[])) for p in prompts]
    assert [f.result(timeout=30).token_ids for f in futures] == [plain_greedy(engine, p, 6) for p in prompts]
    assert set(sizes) == {1}
    scheduler.close()
    with pytest.raises(ValueError, match="max_batch"):
        BatchScheduler(engine, max_batch=0)


def test_a_kv_budget_admits_what_fits_in_arrival_order_and_never_drops_work(engine, monkeypatch) -> None:
    """Each generation reserves its prompt and longest output; under `max_tokens` the rest wait for room, and one
    larger than the whole budget still runs, alone."""
    decoder = build_decoder("none", engine)
    sizes = counting(engine, monkeypatch)
    prompts = [prompt(s, 10) for s in range(4)]
    expected = [plain_greedy(engine, p, 8) for p in prompts]
    for budget, widest in ((40, 2), (20, 1)):  # 18 tokens each: two fit in 40, one in 20
        sizes.clear()
        scheduler, gate, holding = BatchScheduler(engine, max_tokens=budget), Future(), threading.Event()
        scheduler.submit(lambda: holding.set() or gate.result(timeout=30))  # holds the thread until all four are queued
        assert holding.wait(timeout=30)
        futures = [scheduler.submit(lambda p=p: decoder.rounds(p, 8, stop_token_ids=[]), tokens=len(p) + 8)
                   for p in prompts]
        gate.set_result(None)
        assert [f.result(timeout=60).token_ids for f in futures] == expected
        assert max(sizes) == widest and scheduler.peak_batch == widest
        huge = scheduler.submit(lambda: decoder.rounds(prompts[0], 8, stop_token_ids=[]), tokens=10 * budget)
        assert huge.result(timeout=60).token_ids == expected[0]
        scheduler.close()
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        BatchScheduler(engine).submit(lambda: 1, tokens=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        BatchScheduler(engine, max_tokens=0)


def test_a_local_model_reserves_each_requests_prompt_and_output(gguf_path) -> None:
    model = LocalModel(model=gguf_native.build_model(gguf_path, tiny_config()), tokenizer=byte_tokenizer(),
                       name="small-kv", kv_live_tokens=60)
    assert model.scheduler._main.max_tokens == 60
    requests = [GenerationRequest(prompt=q, max_new_tokens=20, temperature=0, stop=[]) for q in QUESTIONS[:3]]
    solo = [model.generate_sync(r).token_ids for r in requests]

    async def together():
        return await asyncio.gather(*(model.generate(r) for r in requests))

    assert [c.token_ids for c in asyncio.run(together())] == solo
    assert model.scheduler.peak_batch == 1  # a prompt of ~40 tokens and 20 more: one at a time in 60
