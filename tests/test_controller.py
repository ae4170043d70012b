"""The adaptive controller's draft budget: acceptance and verify costs learned online (token_spec/controller.py)."""

from __future__ import annotations

import pytest

from thinkahead.token_spec.controller import AdaptiveController, CostCurve


def test_unmeasured_draft_lengths_cost_what_the_line_through_the_measured_ones_says() -> None:
    controller = AdaptiveController(32, smoothing=1.0)
    assert controller.cost(16) == pytest.approx(1.0 + 0.03 * 16)  # nothing measured: the prior slope
    controller.update(0, 0, fed=1, seconds=0.070)  # a plain step
    assert controller.cost(16) == pytest.approx(0.070 * (1 + 0.03 * 16))
    controller.update(4, 4, fed=5, seconds=0.105)  # a CPU: verifying 4 drafted tokens costs half a step more
    assert controller.cost(8) == pytest.approx(0.140)
    assert controller.cost(16) == pytest.approx(0.210)
    assert controller.cost(4) == pytest.approx(0.105)  # measured lengths keep their own cost


def test_a_steep_verify_cost_keeps_drafts_shorter_than_the_prior_would() -> None:
    flat, steep = AdaptiveController(32, smoothing=1.0), AdaptiveController(32, smoothing=1.0)
    for controller, at_four in ((flat, 0.0721), (steep, 0.105)):
        controller.accept_rate = 0.8
        controller.update(0, 0, fed=1, seconds=0.070)
        controller.update(4, 4, fed=5, seconds=at_four)
        controller.accept_rate = 0.8
    assert steep.budget() < flat.budget()
    assert steep.budget() <= 8 < flat.budget()
    falling = AdaptiveController(32, smoothing=1.0)  # a noisy measurement never makes longer drafts cheaper
    falling.update(0, 0, fed=1, seconds=0.070)
    falling.update(2, 2, fed=3, seconds=0.060)
    assert falling.cost(30) >= 0.060


def test_a_cost_measured_on_a_busy_machine_is_forgotten_and_long_drafts_come_back() -> None:
    controller = AdaptiveController(16, smoothing=1.0)
    controller.accept_rate = 0.95
    for k in range(1, 17):  # every length measured while another job held the cores: 10x their cost
        controller.update(k, k, fed=k + 1, seconds=0.7 * (1 + 0.1 * k))
    controller.update(0, 0, fed=1, seconds=0.070)  # then plain steps at the normal speed
    assert controller.budget() == 0
    for _ in range(63):  # plain steps (the probes keep the acceptance high)
        controller.update(0, 0, fed=1, seconds=0.070)
        controller.accept_rate = 0.95
    assert controller.budget() > 8  # the busy costs are forgotten: drafting pays again
    assert set(controller.cost.measured) == {0}
    with pytest.raises(ValueError, match="max_age"):
        CostCurve(0.5, 0.1, max_age=0)
