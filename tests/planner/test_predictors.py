import pytest

from kvmesh.planner.predictors import (
    ConstantPredictor,
    HoltWintersPredictor,
    MovingAveragePredictor,
    make_predictor,
    replay,
)


def test_constant_repeats_the_last_value():
    assert replay(ConstantPredictor(), [3.0, 7.0]).predict() == 7.0


def test_moving_average_forgets_beyond_its_window():
    assert replay(MovingAveragePredictor(window=2), [100.0, 2.0, 4.0]).predict() == 3.0


def test_holt_winters_follows_a_ramp_the_moving_average_lags_behind():
    ramp = [float(v) for v in range(1, 21)]
    trend = replay(HoltWintersPredictor(), ramp)
    average = replay(MovingAveragePredictor(window=3), ramp)
    assert abs(trend.predict() - 21.0) < 1.0
    assert average.predict() == pytest.approx(19.0)
    assert trend.predict(horizon=3) > trend.predict(horizon=1)


def test_the_peak_is_the_far_end_of_a_rise_and_the_near_end_of_a_fall():
    rise = replay(HoltWintersPredictor(), [float(v) for v in range(1, 21)])
    assert rise.peak(horizon=4) == pytest.approx(rise.predict(horizon=4))
    fall = replay(HoltWintersPredictor(), [float(v) for v in range(20, 0, -1)])
    assert fall.peak(horizon=4) == pytest.approx(fall.predict(horizon=1))
    assert fall.peak(horizon=4) > fall.predict(horizon=4)
    flat = replay(MovingAveragePredictor(window=2), [4.0, 6.0])
    assert flat.peak(horizon=4) == flat.predict(horizon=4) == 5.0
    assert replay(ConstantPredictor(), [3.0]).peak(horizon=4) == 3.0


def test_holt_winters_learns_a_season():
    season = [10.0, 20.0, 30.0, 20.0]
    predictor = replay(HoltWintersPredictor(season_length=4), season * 6)
    assert abs(predictor.predict() - 10.0) < 3.0  # the season starts again


def test_holt_winters_falls_back_while_history_is_short():
    predictor = replay(HoltWintersPredictor(fallback_window=2), [4.0, 6.0])
    assert predictor.predict() == 5.0


def test_unknown_predictor_is_refused():
    with pytest.raises(ValueError, match="unknown load predictor"):
        make_predictor("crystal-ball")
