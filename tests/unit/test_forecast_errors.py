"""The planner's rate forecast judged against the rate observed in the interval it was for."""

from __future__ import annotations

import pytest

from kvmesh.replay.report import forecast_errors


def point(observed: float, predicted: float, horizon: int = 1) -> dict[str, float]:
    return {"observed_rate": observed, "predicted_rate": predicted, "horizon": horizon}


def test_each_forecast_is_held_to_the_interval_its_horizon_names():
    # the load goes 10, 20, 30, 20, 10; each forecast is for two steps on: step 0 foresaw 25 for 30
    # (rising), step 1 foresaw 20 for 20 (not rising: falling's side), step 2 foresaw 15 for 10
    timeline = [point(10, 25, 2), point(20, 20, 2), point(30, 15, 2), point(20, 0, 2), point(10, 0, 2)]
    error, rising, falling = forecast_errors(timeline)
    assert rising == pytest.approx((25 - 30) / 30)  # foresaw too little on the way up
    assert falling == pytest.approx((0 + (15 - 10) / 10) / 2)  # and too much on the way down
    assert error == pytest.approx((5 / 30 + 0 + 5 / 10) / 3)


def test_intervals_without_arrivals_and_forecasts_past_the_end_are_left_out():
    assert forecast_errors([point(0, 5), point(0, 5)]) == (None, None, None)
    assert forecast_errors([point(10, 12)]) == (None, None, None)
    error, rising, falling = forecast_errors([point(10, 12), point(10, 0)])
    assert (error, rising, falling) == (pytest.approx(0.2), None, pytest.approx(0.2))
