"""The SLA's miss budget as the planner spends it: the misses a fleet's size can change, and those it
cannot.

A request whose prefill alone outlasts the TTFT target misses on any fleet ("unservable"). It still
counts against the SLA, so the goal leaves sizing only the rest of the budget to spend: with a 0.95
goal and 2.65% of the requests unservable (the family's prompts-2x trace), 2.35% for every other
miss. Two things follow, both here:

- an interval is judged with its unservable misses charged at their share of the window, not as
  they land: sizing cannot choose where a 60,000-token prompt falls, and counted as they land they
  made intervals below the goal at random, each tightening the planner's cap or growing the pool;
- the margins the planner keeps above the goal (to relax its cap, to shrink) are shares of the
  budget sizing can spend, scaled by it: a margin of three points of a five-point budget is more
  than the whole of a 2.35-point one, and no shrink near capacity could ever pass it.

With no unservable request both are what they were: the raw attainment and the full margins.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvmesh.planner.load import IntervalObservation


def unservable(observation: IntervalObservation, prefill_alone_ms: Callable[[float], float], target_ms: float) -> int:
    """How many of the interval's TTFT misses no fleet could have served in time: their uncached
    prompt's prefill alone (``prefill_alone_ms``) outlasts ``target_ms``."""
    return sum(1 for tokens in observation.ttft_missed_uncached if prefill_alone_ms(tokens) > target_ms)


@dataclass(frozen=True)
class Judged:
    """One or more intervals' requests as the planner counts them."""

    finished: int
    met: float
    unservable: int

    @property
    def attainment(self) -> float | None:
        return self.met / self.finished if self.finished else None


def pooled(observations: Iterable[tuple[IntervalObservation, int]]) -> Judged:
    """The intervals' requests pooled: (observation, its unservable count) each."""
    finished = unservable_count = 0
    met = 0.0
    for observation, count in observations:
        finished += observation.finished
        met += (observation.sla_attainment or 0.0) * observation.finished
        unservable_count += count
    return Judged(finished, met, unservable_count)


# a pool that missed at most this share of what the goal lets sizing miss (at 0.95 with nothing
# unservable: met 0.99) spends almost nothing of the SLA's window (decision 68)
LITTLE_MISSED = 0.2


@dataclass
class MissBudget:
    """The requests finished within the SLA's window (``window_s``), and what they leave to spend."""

    goal: float
    window_s: float
    _window: deque[tuple[IntervalObservation, int]] = field(default_factory=deque, init=False)

    def add(self, observation: IntervalObservation, unservable_count: int) -> None:
        """Counts ``observation`` (with its unservable misses) and forgets what left the window."""
        if observation.finished and observation.sla_attainment is not None:
            self._window.append((observation, unservable_count))
        since = observation.start_s + observation.duration_s - self.window_s
        while self._window and self._window[0][0].start_s + self._window[0][0].duration_s <= since:
            self._window.popleft()

    def attainment(self) -> float | None:
        """The SLA's attainment over the window, as measured (None: nothing finished in it)."""
        return pooled(self._window).attainment

    def unservable_share(self) -> float:
        """The share of the window's requests that no fleet could have served in time."""
        window = pooled(self._window)
        return window.unservable / window.finished if window.finished else 0.0

    def spendable(self) -> float:
        """The share of the goal's miss budget that sizing can spend: 1 with no unservable request,
        0 where they alone use it up (no fleet reaches the goal)."""
        allowed = 1.0 - self.goal
        return max(0.0, allowed - self.unservable_share()) / allowed if allowed > 0 else 0.0

    def margin(self, points: float) -> float:
        """A margin above the goal, stated against the whole budget, scaled to what sizing can spend."""
        return points * self.spendable()

    def missing_little(self, attained: float | None) -> bool:
        """Whether requests judged at ``attained`` (:meth:`judged`) missed at most ``LITTLE_MISSED``
        of what the goal lets sizing miss (False: none judged)."""
        allowed = (1.0 - self.goal) * self.spendable()
        return attained is not None and 1.0 - attained <= LITTLE_MISSED * allowed

    def judged(self, requests: Judged) -> float | None:
        """``requests``' attainment with their unservable misses charged at the window's share of
        them instead of as they landed (None: none finished). Over the whole window it is the
        measured attainment."""
        if not requests.finished:
            return None
        landed = requests.unservable / requests.finished
        return min(1.0, max(0.0, requests.met / requests.finished + landed - self.unservable_share()))
