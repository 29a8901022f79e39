"""Load predictors: from the values of past intervals, the next intervals' values (``predict``: the
one ``horizon`` ahead; ``peak``: the largest up to it).

``constant`` repeats the last interval; ``moving-average`` averages the last ``window``;
``holt-winters`` fits additive-trend exponential smoothing (with a season once two seasons of
history exist) from statsmodels, refitted every interval, and falls back to the moving average
while the history is too short for a fit.

Every predictor's state is its history, so a restarted planner rebuilds it by replaying the stored
observations (see ``state.py``).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Iterable
from typing import Protocol

PREDICTORS = ("constant", "moving-average", "holt-winters")
HISTORY_LIMIT = 512  # values kept per series; older ones no longer change a forecast much


class Predictor(Protocol):
    def observe(self, value: float) -> None: ...
    def predict(self, horizon: int = 1) -> float:
        """The value ``horizon`` intervals after the last observed one."""
        ...

    def peak(self, horizon: int = 1) -> float:
        """The largest value predicted for the next ``horizon`` intervals."""
        ...


class ConstantPredictor:
    """Next = last."""

    def __init__(self) -> None:
        self._last = 0.0

    def observe(self, value: float) -> None:
        self._last = value

    def predict(self, horizon: int = 1) -> float:
        return self._last

    def peak(self, horizon: int = 1) -> float:
        return self._last


class MovingAveragePredictor:
    """Next = mean of the last ``window`` values."""

    def __init__(self, window: int = 5) -> None:
        if window <= 0:
            raise ValueError("the moving average needs a positive window")
        self._values: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self._values.append(value)

    def predict(self, horizon: int = 1) -> float:
        return sum(self._values) / len(self._values) if self._values else 0.0

    def peak(self, horizon: int = 1) -> float:
        return self.predict(horizon)


class HoltWintersPredictor:
    """Exponential smoothing with an additive damped trend, and an additive season of
    ``season_length`` intervals once the history holds two seasons (statsmodels)."""

    MIN_HISTORY = 6

    def __init__(self, season_length: int = 0, fallback_window: int = 5) -> None:
        self.season_length = season_length
        self._history: deque[float] = deque(maxlen=HISTORY_LIMIT)
        self._fallback = MovingAveragePredictor(fallback_window)

    def observe(self, value: float) -> None:
        self._history.append(value)
        self._fallback.observe(value)

    def predict(self, horizon: int = 1) -> float:
        return self._path(horizon)[-1]

    def peak(self, horizon: int = 1) -> float:
        return max(self._path(horizon))

    def _path(self, horizon: int) -> list[float]:
        """The forecasts for the next ``horizon`` intervals (each at least 0), from one fit."""
        history = list(self._history)
        if len(history) < self.MIN_HISTORY or max(history) == min(history):
            return [self._fallback.predict()] * horizon
        from statsmodels.tsa.holtwinters import ExponentialSmoothing  # slow to import: only when used

        seasonal = self.season_length >= 2 and len(history) >= 2 * self.season_length
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence chatter on short, noisy series
            model = ExponentialSmoothing(
                history,
                trend="add",
                damped_trend=True,
                seasonal="add" if seasonal else None,
                seasonal_periods=self.season_length if seasonal else None,
                initialization_method="estimated",
            )
            path = [float(value) for value in model.fit().forecast(horizon)]
        if not all(math.isfinite(value) for value in path):
            return [self._fallback.predict()] * horizon
        return [max(0.0, value) for value in path]


def make_predictor(name: str, window: int = 5, season_length: int = 0) -> Predictor:
    if name == "constant":
        return ConstantPredictor()
    if name == "moving-average":
        return MovingAveragePredictor(window)
    if name == "holt-winters":
        return HoltWintersPredictor(season_length, window)
    raise ValueError(f"unknown load predictor {name!r}; choose one of {', '.join(PREDICTORS)}")


def replay(predictor: Predictor, values: Iterable[float]) -> Predictor:
    for value in values:
        predictor.observe(value)
    return predictor
