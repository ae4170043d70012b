"""Priced draft rows: a drafter whose node values are calibrated worths (`priced_drafts`) sends them with its verify
(`ForwardCall.values`), and the scheduler keeps, over every sequence of the step, the rows that raise the forward's
expected tokens per second (goodput.price_rows); the generation keeps what was verified and stays exact. The draft
head's worths come from `ValueCalibration`, which learns what its estimates came to."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("thinkahead.models.engine.kernels._layer_native")
pytest.importorskip("thinkahead.models.engine.kernels._kquant_native")

from thinkahead.models.engine.goodput import allocate
from thinkahead.token_spec.pricing import price_rows
from thinkahead.models.engine.scheduler import BatchScheduler
from thinkahead.token_spec.controller import FixedController
from thinkahead.token_spec.decoder import SpeculativeDecoder, plain_greedy
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.head_drafter import HeadDrafter
from thinkahead.token_spec.value_calibration import CALIBRATION_PRIOR, ValueCalibration
from thinkahead.token_spec.verify import SamplingParams

from tests.test_draft_head import Fixed, a_head, prompt
from tests.test_gguf_native import HIDDEN, tiny_config, tiny_gguf  # noqa: F401 (fixture)
from tests.test_ragged_batch import engine  # noqa: F401 (fixture: the tiny GGUF model's engine, batching rows)
from tests.tiny_models import VOCAB


def line(per_row: float):
    return lambda k: 1.0 + per_row * k  # seconds of a forward of k + 1 rows


# ------------------------------------------------------------------ the choice


def test_rows_are_kept_worthiest_first_while_they_raise_the_tokens_per_second() -> None:
    # two sequences verify anyway (2 rows, 2 tokens); a row costs 0.2 of a forward: worth it from 0.4 tokens on
    assert price_rows([[0.9, 0.8, 0.3], [0.5, 0.1]], line(0.2), rows=2, expected=2.0) == [2, 1]
    assert price_rows([[0.9, 0.8, 0.3], [0.5, 0.1]], lambda k: 1.0, rows=2, expected=2.0) == [3, 2]  # rows free
    assert price_rows([[0.9], [0.9]], line(0.2), rows=2, expected=2.0, max_rows=3) == [1, 0]  # never past max_rows
    # a row is worth no more than the one before it (rows are cut from the end): 0.9 behind 0.05 is not reached
    assert price_rows([[0.05, 0.9]], line(0.01), rows=1, expected=1.0) == [2] != price_rows(
        [[0.05, 0.9]], line(0.06), rows=1, expected=1.0)
    assert price_rows([[0.0, 0.0]], lambda k: 1.0, rows=1, expected=1.0) == [0]  # nothing expected: not weighed
    assert price_rows([], line(0.2), rows=0, expected=0.0) == []


def test_a_chain_at_rate_a_is_priced_as_the_plan_sizes_it() -> None:
    # allocate is price_rows over each sequence's chain of worths a, a^2, ...
    for rates in ([0.8] * 4, [0.95, 0.1, 0.5], [0.6, 0.6]):
        worths = [[a ** k for k in range(1, 65)] for a in rates]
        assert allocate(rates, line(0.15)) == price_rows(worths, line(0.15), rows=len(rates), expected=len(rates))


# ------------------------------------------------------------------ in a batch


class Oracle:
    """Drafts the next two tokens of the plain greedy output (worth 0.99 each), then three that are worth nothing."""

    model_free = True
    priced_drafts = True
    name = "oracle"

    def __init__(self, outputs: dict[tuple[int, ...], list[int]]) -> None:
        self.outputs, self.full = outputs, {}

    def start(self, rid, prompt_ids, params, session_id=None) -> None:
        self.full[rid] = list(prompt_ids) + self.outputs[tuple(prompt_ids)]

    def propose(self, rid, context, budget) -> Draft:
        right = self.full[rid][len(context):len(context) + 2]
        junk = [(right[-1] + 1 + i) % VOCAB for i in range(3)] if right else []
        return Draft.chain(right + junk, [0.99] * len(right) + [0.0] * len(junk)).truncated(budget)

    def observe(self, rid, accepted, proposed) -> None: ...

    def finish(self, rid) -> None:
        self.full.pop(rid, None)


def test_a_batch_verifies_only_the_draft_rows_worth_their_place_and_each_output_is_plain_greedy(engine) -> None:
    jobs = [(prompt(s, 9 + 5 * s), 20 + 3 * s) for s in range(4)]
    expected = [plain_greedy(engine, p, n) for p, n in jobs]
    decoder = SpeculativeDecoder(engine, Oracle({tuple(p): out for (p, _), out in zip(jobs, expected)}),
                                 FixedController(8))
    verifies, real = [], engine.forward_batch
    engine.forward_batch = lambda calls: verifies.extend(len(c.token_ids) for c in calls if not c.last_only) or real(
        calls)
    scheduler = BatchScheduler(engine, prefill_chunk=8)
    try:
        futures = [scheduler.submit(lambda p=p, n=n: decoder.rounds(p, n, stop_token_ids=[], share=scheduler.share()))
                   for p, n in jobs]
        results = [f.result(timeout=60) for f in futures]
    finally:
        scheduler.close()
        engine.forward_batch = real
    assert [r.token_ids for r in results] == expected
    assert max(verifies) <= 3  # the fed token and the two right guesses: the worthless rows never ran
    assert verifies.count(3) >= 4
    for r in results:  # what the generation counts as drafted is what was verified, and all of it held
        assert r.stats.spec_num_correct_drafts == r.stats.spec_num_proposed_drafts > 0


# ------------------------------------------------------------------ calibration


def test_an_estimate_is_its_own_worth_until_tokens_given_it_are_counted() -> None:
    calibration = ValueCalibration(prior=CALIBRATION_PRIOR, memory=64)
    assert calibration("head", 0.55) == 0.55 and calibration("head", 1.7) == 1.0
    for i in range(40):  # estimates of 0.5-0.6 that held one time in five
        calibration.record("head", 0.55, i % 5 == 0)
    assert calibration("head", 0.58) == pytest.approx((8 + CALIBRATION_PRIOR * 0.58) / (40 + CALIBRATION_PRIOR))
    assert calibration("head", 0.95) == 0.95 and calibration("inner", 0.55) == 0.55  # other parts, other keys
    for _ in range(200):  # the workload changes: the old counts fade (halved past `memory`)
        calibration.record("head", 0.55, True)
    assert calibration("head", 0.55) > 0.9  # kept whole, the 32 old misses would hold it near 0.86
    assert calibration.rates()[("head", 5)][0] <= 64
    with pytest.raises(ValueError, match="prior must be > 0"):
        ValueCalibration(prior=0)


def test_the_head_counts_only_the_nodes_the_target_verified(engine) -> None:
    inner, model = Fixed(), engine.model
    drafter = HeadDrafter(a_head(), model.get_input_embeddings(), model.lm_head, VOCAB, inner)
    context = prompt(2, 16)
    drafter.start("r", context, SamplingParams())
    torch.manual_seed(3)
    drafter.observe_hidden("r", 60 * torch.randn(HIDDEN), len(context))  # a head sure of four guesses
    draft = drafter.propose("r", context, 4)
    assert len(draft) == 4
    verified = draft.truncated(2)  # a scheduler kept two rows: the target saw those only
    drafter.observe("r", [draft.token_ids[0], (draft.token_ids[1] + 1) % VOCAB], verified)
    counted = {key: n_rate for (key, _), n_rate in drafter.calibration.rates().items()}
    assert counted == {("head", 1): (1, 1.0), ("head", 2): (1, 0.0)}


# ------------------------------------------------------------------ load work off the caller's thread


CHECK_THREADS = """
import os, time, torch
from thinkahead.models.engine.threads import on_own_thread
count = lambda: len(os.listdir("/proc/self/task"))
before = count()
assert on_own_thread(lambda: float(torch.ones(4_000_000).sum())) == 4_000_000.0
for _ in range(200):  # its OpenMP workers end after their thread: give them a moment
    if count() == before:
        break
    time.sleep(0.01)
own = count() - before
torch.ones(4_000_000).sum()  # the same work on this thread: it keeps a team, and the team's workers stay
print(own, count() - before)
"""


def test_load_work_on_its_own_thread_leaves_no_openmp_workers_behind_and_raises_what_it_raised() -> None:
    import os
    import subprocess
    import sys

    from thinkahead.models.engine.threads import on_own_thread

    if torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task"):
        pytest.skip("needs torch's intra-op threads and /proc")
    # a process of its own: this one's thread count moves with other tests' threads
    out = subprocess.run([sys.executable, "-c", CHECK_THREADS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    own, here = map(int, out.stdout.split())
    assert own == 0 and here >= 1
    with pytest.raises(ValueError, match="bad head"):
        on_own_thread(lambda: (_ for _ in ()).throw(ValueError("bad head")))
