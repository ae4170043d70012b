"""The goodput plan: draft lengths over the whole cost curve, the curve's shape measured on the engine once,
and the acceptance a new sequence starts from."""

from __future__ import annotations

import pytest

pytest.importorskip("thinkahead.models.engine.kernels._kquant_native")

from thinkahead.models.engine import goodput
from thinkahead.models.engine.goodput import TRUST_MIN, RowCost, Trust, allocate, measure_rows
from thinkahead.models.engine.scheduler import BatchScheduler
from thinkahead.token_spec.controller import FixedController
from thinkahead.token_spec.decoder import SpeculativeDecoder, plain_greedy
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.engine import run_inline
from thinkahead.token_spec.names import ACCEPT_PRIOR
from thinkahead.token_spec.presets import build_decoder

from tests.test_batching import engine, gguf_path, prompt  # noqa: F401 (fixtures)
from tests.test_gguf_native import tiny_config, tiny_gguf  # noqa: F401 (fixture)
from tests.tiny_models import VOCAB


def tiles(k: int) -> float:
    """A CPU's shape (goodput.py's docstring): the first draft rows dear, then nearly free up to a full tile."""
    rows = k + 1
    return 1.0 if rows <= 4 else 1.5 + 0.01 * (rows - 5)


def test_the_plan_weighs_every_prefix_so_dear_first_rows_do_not_hide_cheap_ones() -> None:
    # One more token never pays at 4 rows (4.9 tokens for 1.5x the time), a dozen more do: stopping at the
    # first token that does not pay (the plan before) drafted nothing here.
    lengths = allocate([0.9] * 4, tiles)
    assert sum(lengths) >= 8 and max(lengths) - min(lengths) <= 1
    assert allocate([0.2] * 4, tiles) == [0] * 4  # drafts that miss still do not pay
    assert sum(allocate([0.99] * 4, lambda k: 1.0, max_rows=10)) == 6  # never past the step's rows


def test_the_row_cost_keeps_the_calibrated_shape_and_follows_the_measured_level() -> None:
    cost = RowCost()
    assert not cost.calibrated and cost(0) == 1.0  # nothing measured: the prior line
    cost.calibrate({0: 0.03, 7: 0.09, 15: 0.14, 31: 0.21, 23: 0.20})
    assert cost.calibrated
    assert cost(0) == pytest.approx(0.03) and cost(3) == pytest.approx(0.03 + 0.06 * 3 / 7)  # between points
    assert cost(47) == pytest.approx(0.21 + 0.01 / 8 * 16)  # past the last: its segment's slope
    before = [cost(k) for k in range(64)]
    assert before == sorted(before)  # never cheaper for more rows
    for _ in range(40):  # the machine (or the KV) makes every step twice as dear
        cost.update(7, 0.18)
    assert cost.level == pytest.approx(2.0, rel=1e-3)
    assert [cost(k) for k in range(64)] == pytest.approx([2 * b for b in before], rel=1e-3)  # the shape stays
    with pytest.raises(ValueError, match="calibration points"):
        cost.calibrate({0: 0.0})


def test_measuring_rows_times_each_size_and_leaves_the_engine_as_it_was(engine) -> None:
    p = prompt(3, 20)
    want = plain_greedy(engine, p, 12)
    points = measure_rows(engine, rows=(1, 4, 16), context=8, repeats=1)
    assert sorted(points) == [0, 3, 15] and all(s > 0 for s in points.values())
    assert plain_greedy(engine, p, 12) == want
    with pytest.raises(ValueError, match="rows must be"):
        measure_rows(engine, rows=(0,))


def test_the_scheduler_measures_its_engine_once_when_sequences_first_share_a_forward(engine, monkeypatch) -> None:
    calls = []
    real = goodput.measure_rows
    monkeypatch.setattr("thinkahead.models.engine.scheduler.measure_rows",
                        lambda e: calls.append(e) or real(e, rows=(1, 2, 8), context=4, repeats=1))
    decoder = build_decoder("suffix", engine)
    jobs = [prompt(s, 10 + s) for s in range(3)]
    want = [plain_greedy(engine, p, 16) for p in jobs]
    scheduler = BatchScheduler(engine, prefill_chunk=8)

    def run(ps):
        futures = [scheduler.submit(lambda p=p: decoder.rounds(p, 16, stop_token_ids=[], share=scheduler.share()))
                   for p in ps]
        return [f.result(timeout=60).token_ids for f in futures]

    assert run(jobs[:1]) == want[:1]
    assert calls == [] and not scheduler.cost.calibrated  # alone: the decoder's own controller, no plan
    assert run(jobs) == want
    assert run(jobs) == want
    assert calls == [engine] and scheduler.cost.calibrated  # once, on the first shared forward
    scheduler.close()


def test_a_new_sequence_starts_from_what_its_engines_sequences_have_shown(engine) -> None:
    scheduler = BatchScheduler(engine)

    def report(rate: float):
        share = scheduler.share()
        start = share.prior
        for _ in range(30):
            share.limit(rate)
        return start

    assert scheduler.run(lambda: report(0.95)) == ACCEPT_PRIOR  # nothing shown yet
    assert scheduler.run(lambda: report(0.95)) > 0.9

    class Share:  # what the decoder asks of its batch, recorded
        prior, alone, rates = 0.9, False, []

        def limit(self, rate: float) -> int:
            self.rates.append(rate)
            return 0

    share = Share()
    run_inline(engine, build_decoder("suffix", engine).rounds(prompt(1, 12), 4, stop_token_ids=[], share=share))
    assert share.rates[0] == 0.9  # its estimate began at the batch's prior, not at ACCEPT_PRIOR
    scheduler.close()


def test_the_plans_trust_follows_what_its_drafts_kept_and_comes_back_when_it_stops_drafting() -> None:
    trust = Trust()
    assert trust.factor == 1.0  # nothing verified yet
    for _ in range(200):  # drafts that keep a third of what the estimates expected
        trust.update(3.0, 1)
        trust.step()
    assert trust.factor == pytest.approx(1 / 3, abs=0.03)
    def line(k: int) -> float:
        return 1 + 0.15 * k

    assert allocate([0.8] * 4, line) != [0] * 4 and allocate([0.8] * 4, line, trust=trust.factor) == [0] * 4
    for _ in range(200):  # no drafts: the record fades, so the plan will try again
        trust.step()
    assert trust.factor > 0.95
    for _ in range(50):
        trust.update(5.0, 0)
    assert trust.factor == TRUST_MIN  # bounded: never prices drafts at nothing
    with pytest.raises(ValueError, match="must be >= 0"):
        trust.update(-1.0, 0)


class FirstTokenDrafter:
    """Drafts the right next token (it knows the greedy reply) followed by wrong ones."""

    name, model_free = "first-token", True

    def __init__(self, prompt: list[int], reply: list[int]) -> None:
        self.prompt, self.reply = prompt, reply

    def start(self, rid, prompt_ids, params, session_id=None) -> None:
        pass

    def propose(self, rid, context, budget: int) -> Draft:
        i = len(context) - len(self.prompt)
        if i >= len(self.reply) or budget <= 0:
            return Draft()
        after = self.reply[i + 1] if i + 1 < len(self.reply) else 0
        return Draft.chain([self.reply[i], (after + 1) % VOCAB, (after + 2) % VOCAB])

    def observe(self, rid, accepted, proposed) -> None:
        pass

    def finish(self, rid) -> None:
        pass


def test_a_sequences_estimate_weighs_every_depth_of_its_unverified_drafts(engine) -> None:
    # Drafts whose first token always hits and whose second never does accept one token in two tries per draft;
    # checking only each draft's first token (as before) took them for drafts that always hit.
    p = prompt(2, 14)
    reply = plain_greedy(engine, p, 40)

    class Share:  # a batch that gives no room: every draft is a probe
        prior, alone, rates = 0.5, False, []

        def limit(self, rate: float) -> int:
            self.rates.append(rate)
            return 0

        def verified(self, expected: float, accepted: int) -> None:
            raise AssertionError("nothing was verified")

    share = Share()
    decoder = SpeculativeDecoder(engine, FirstTokenDrafter(p, reply), FixedController(8))
    out = run_inline(engine, decoder.rounds(p, 40, stop_token_ids=[], share=share))
    assert out.token_ids == reply
    assert 0.4 < share.rates[-1] < 0.6


def three_together(engine, drafter: str, tokens: int) -> BatchScheduler:
    """Three prompts through one scheduler at once; each reply checked against its solo plain greedy reply."""
    decoder = build_decoder(drafter, engine)
    scheduler = BatchScheduler(engine, prefill_chunk=8)
    jobs = [prompt(s, 10 + s) for s in range(3)]
    futures = [scheduler.submit(lambda p=p: decoder.rounds(p, tokens, stop_token_ids=[], share=scheduler.share()))
               for p in jobs]
    assert [f.result(timeout=60).token_ids for f in futures] == [plain_greedy(engine, p, tokens) for p in jobs]
    scheduler.close()
    return scheduler


def test_sequences_that_never_draft_cost_no_calibration(engine, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr("thinkahead.models.engine.scheduler.measure_rows", lambda e: calls.append(e) or {0: 1.0})
    scheduler = three_together(engine, "none", 12)
    assert scheduler.peak_batch > 1 and calls == []  # they shared forwards, and nothing was measured for a plan


def test_an_engine_that_cannot_be_measured_is_planned_by_the_line_and_serves_exactly(engine, monkeypatch, caplog) -> None:
    def broken(e):
        raise RuntimeError("no scratch sequence here")

    monkeypatch.setattr("thinkahead.models.engine.scheduler.measure_rows", broken)
    scheduler = three_together(engine, "suffix", 14)
    assert not scheduler.cost.calibrated and "learns it online" in caplog.text
