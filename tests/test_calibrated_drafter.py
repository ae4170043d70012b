"""`CalibratedDrafter`: a model-free drafter's estimates turned into the rates at which they came true, so its drafts
are priced row by row (`priced_drafts`): the decoder and the scheduler verify only the rows worth their place."""

from __future__ import annotations

import pytest

pytest.importorskip("thinkahead.models.engine.kernels._layer_native")
pytest.importorskip("thinkahead.models.engine.kernels._kquant_native")

from thinkahead.models.engine.scheduler import BatchScheduler
from thinkahead.token_spec.controller import AdaptiveController
from thinkahead.token_spec.decoder import SpeculativeDecoder, plain_greedy
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.drafters import CombinedDrafter, SuffixDrafter
from thinkahead.token_spec.pricing import price_rows
from thinkahead.token_spec.presets import build_decoder, small_model_drafter
from thinkahead.token_spec.value_calibration import (
    CALIBRATION_PRIOR, COPY_MATCH, CalibratedDrafter, ValueCalibration, depth_key,
)
from thinkahead.token_spec.verify import SamplingParams

from tests.test_draft_head import prompt
from tests.test_gguf_native import tiny_config, tiny_gguf  # noqa: F401 (fixture)
from tests.test_ragged_batch import engine  # noqa: F401 (fixture: the tiny GGUF model's engine, batching rows)
from tests.tiny_models import VOCAB


class Sure:
    """Drafts `wrong` tokens it is sure of (estimate 1.0) after `right` correct ones, from `full` (the context and
    its plain greedy continuation), with a match of `match` tokens."""

    model_free = True
    name = "sure"

    def __init__(self, full: dict[tuple[int, ...], list[int]], right: int, wrong: int, match: int = 2) -> None:
        self.full, self.right, self.wrong, self.match, self.rows = full, right, wrong, match, {}
        self.told: list[str] = []

    def start(self, rid, prompt_ids, params, session_id=None) -> None:
        self.rows[rid] = self.full[tuple(prompt_ids)]
        self.told.append("start")

    def propose(self, rid, context, budget) -> Draft:
        good = self.rows[rid][len(context):len(context) + self.right]
        bad = [(t + 1) % VOCAB for t in self.rows[rid][len(context) + len(good):][:self.wrong]]
        return Draft.chain(good + bad, [1.0] * (len(good) + len(bad)), match_len=self.match).truncated(budget)

    def observe(self, rid, accepted, proposed) -> None:
        self.told.append("observe")

    def finish(self, rid) -> None:
        self.told.append("finish")


def test_depths_are_keyed_one_by_one_then_by_doubling_spans() -> None:
    assert [depth_key(d) for d in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == [1, 2, 3, 4, 8, 8, 16, 16, 17, 17]


def test_a_drafter_sure_of_wrong_tokens_is_learned_and_its_rows_stop_paying() -> None:
    context = prompt(1, 12)
    full = {tuple(context): context + prompt(4, 80)}
    drafter = CalibratedDrafter(Sure(full, right=1, wrong=3))
    assert drafter.name == "sure" and drafter.priced_drafts
    drafter.start("r", context, SamplingParams())
    first = drafter.propose("r", context, 8)
    assert first.probs == [1.0] * 4  # nothing counted yet: its own estimates
    cost = lambda k: 1.0 + 0.3 * k  # noqa: E731 - a draft row costs 0.3 of a forward
    assert price_rows([first.probs], cost, 1, 1.0) == [4]
    at = list(context)
    for _ in range(30):
        draft = drafter.propose("r", at, 8)
        kept = full[tuple(context)][len(at):len(at) + 2]  # the right guess, then the target's own token
        drafter.observe("r", kept, draft.truncated(3))  # a scheduler verified three rows of four
        at += kept
    rates = {key: n_rate for (key, _), n_rate in drafter.calibration.rates().items()}
    assert rates == {("match", 1): (30, 1.0), ("match", 2): (30, 0.0), ("match", 3): (30, 0.0)}  # not the 4th
    later = drafter.propose("r", at, 8)
    assert later.probs[0] == pytest.approx(1.0) and later.probs[1] == pytest.approx(
        CALIBRATION_PRIOR / (30 + CALIBRATION_PRIOR))
    assert price_rows([later.probs], cost, 1, 1.0) == [1]  # the sure-but-wrong rows are no longer verified
    drafter.finish("r")
    assert drafter.inner.told == ["start"] + ["observe"] * 30 + ["finish"]


def test_a_long_match_is_a_copy_calibrated_apart() -> None:
    calibration = ValueCalibration()
    pending: list = []
    copy = calibration.worths(Draft.chain([5, 6], [1.0, 1.0], match_len=COPY_MATCH), "copy", pending)
    assert [key for key, _, _ in pending] == [("copy", 1), ("copy", 2)] and copy.score == 2.0
    drafter = CalibratedDrafter(Sure({(1, 2): [1, 2, 3, 4, 5]}, right=2, wrong=0, match=COPY_MATCH))
    drafter.start("r", [1, 2], SamplingParams())
    drafter.propose("r", [1, 2], 4)
    drafter.observe("r", [3, 4, 5], Draft.chain([3, 4]))
    assert set(key for key, _ in drafter.calibration.rates()) == {("copy", 1), ("copy", 2)}


def test_only_a_model_free_drafter_is_calibrated_and_the_named_kinds_are(engine) -> None:
    with pytest.raises(ValueError, match="only a model-free drafter's drafts are calibrated, got DraftModelDrafter"):
        CalibratedDrafter(small_model_drafter(engine))
    for kind, inner in (("suffix", SuffixDrafter), ("combined", CombinedDrafter)):
        drafter = build_decoder(kind, engine).drafter
        assert isinstance(drafter, CalibratedDrafter) and isinstance(drafter.inner, inner)
    assert not isinstance(build_decoder("suffix-tree", engine).drafter, CalibratedDrafter)  # its own length rule


def batch(engine, drafter, jobs) -> tuple[list[list[int]], list[int]]:
    """Each job's output, and the rows of every verify forward, with `drafter` over a scheduler on which a draft
    row costs 0.3 of a forward (the tiny model's rows are nearly free)."""
    decoder = SpeculativeDecoder(engine, drafter, AdaptiveController(8))
    verifies, real = [], engine.forward_batch
    engine.forward_batch = lambda calls: verifies.extend(len(c.token_ids) for c in calls if not c.last_only) or real(
        calls)
    scheduler = BatchScheduler(engine, prefill_chunk=8)
    lane = scheduler._engine(engine)
    lane.calibrating = False
    lane.cost.calibrate({0: 1.0, 64: 1.0 + 64 * 0.3})
    try:
        futures = [scheduler.submit(lambda p=p, n=n: decoder.rounds(p, n, stop_token_ids=[], share=scheduler.share()))
                   for p, n in jobs]
        return [f.result(timeout=60).token_ids for f in futures], verifies
    finally:
        scheduler.close()
        engine.forward_batch = real


def test_in_a_batch_learned_worths_cut_the_wrong_rows_and_every_output_is_plain_greedy(engine) -> None:
    jobs = [(prompt(s, 9 + 5 * s), 30 + 3 * s) for s in range(3)]
    expected = [plain_greedy(engine, p, n) for p, n in jobs]
    full = {tuple(p): list(p) + out for (p, _), out in zip(jobs, expected)}
    priced, rows = batch(engine, CalibratedDrafter(Sure(full, right=2, wrong=6)), jobs)
    unpriced, unpriced_rows = batch(engine, Sure(full, right=2, wrong=6), jobs)
    assert priced == unpriced == expected
    assert max(rows[:3]) > 3  # at first it is trusted: sure-but-wrong rows are verified
    # learned: the fed token and the two right guesses (a sequence left alone may try the others again: rows are
    # cheaper beside fewer), so fewer verifies than sizing chains by an acceptance rate
    assert max(rows[5:-4]) == 3 and len(rows) < len(unpriced_rows)
