"""How requests ended, recently and in total: what ``kvmesh inspect router`` shows per replica."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable

DEFAULT_WINDOW_SECONDS = 60.0


class OutcomeWindow:
    """Counts request outcomes since start and within a sliding window.

    Guarantees: ``recent()`` counts exactly the outcomes recorded within the last ``window_seconds``
    by the injected clock; memory is bounded by the outcomes of one window.
    """

    def __init__(self, window_seconds: float = DEFAULT_WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.window_seconds = window_seconds
        self._clock = clock
        self._recent: deque[tuple[float, str]] = deque()
        self._totals: Counter[str] = Counter()

    def record(self, outcome: str) -> None:
        self._totals[outcome] += 1
        self._recent.append((self._clock(), outcome))
        self._prune()

    def recent(self) -> dict[str, int]:
        self._prune()
        return dict(Counter(outcome for _, outcome in self._recent))

    def totals(self) -> dict[str, int]:
        return dict(self._totals)

    def _prune(self) -> None:
        horizon = self._clock() - self.window_seconds
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
