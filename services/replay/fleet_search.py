"""The smallest fixed fleet that reaches an SLA goal on a trace, and a planner capped at one: what
the planner's bench compares against (``bench/planner_bench.py``; docs/planner.md).

A search asks ``attains(fleet)`` (a replay's SLA attainment with that fleet) and takes attainment
as monotone in each pool's size, so it bisects instead of sweeping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Fleet:
    prefill: int
    decode: int  # the aggregated pool when prefill is 0

    def options(self) -> dict:
        return {"workers": self.decode, "prefill_workers": self.prefill}

    def __str__(self) -> str:
        return f"{self.prefill}P+{self.decode}D" if self.prefill else str(self.decode)


def smallest_reaching(reaches: Callable[[int], bool], low: int, high: int) -> int | None:
    """The smallest n in [low, high] with ``reaches(n)`` (taken as monotone); None when ``high`` does not."""
    if not reaches(high):
        return None
    while low < high:
        middle = (low + high) // 2
        if reaches(middle):
            high = middle
        else:
            low = middle + 1
    return high


def smallest_fleet(attains: Callable[[Fleet], float], disaggregated: bool, most: int, goal: float) -> Fleet | None:
    """The smallest fixed fleet (at most ``most`` workers a pool) whose attainment reaches ``goal``.
    Disaggregated: the least prefill pool that reaches it with ``most`` decode workers, then for it
    and one or two more prefill workers the least decode pool; the smallest total wins."""

    def reaches(fleet: Fleet) -> bool:
        return attains(fleet) >= goal

    if not disaggregated:
        size = smallest_reaching(lambda n: reaches(Fleet(0, n)), 1, most)
        return None if size is None else Fleet(0, size)
    least = smallest_reaching(lambda n: reaches(Fleet(n, most)), 1, most)
    if least is None:
        return None
    # the least prefill pool may need a large decode pool to make up for it (local prefills on the
    # decode workers): one or two more prefill workers can make a smaller fleet
    fleets = []
    for prefill in range(least, min(least + 2, most) + 1):
        decode = smallest_reaching(lambda n, p=prefill: reaches(Fleet(p, n)), 1, most)
        if decode is not None:
            fleets.append(Fleet(prefill, decode))
    return min(fleets, key=lambda f: (f.prefill + f.decode, f.prefill), default=None)


def profile_of(phase: str, period: float, amplitude: float) -> str:
    """The sinusoidal arrival profile starting at its trough or at its crest."""
    offset = period * 3 / 4 if phase == "trough" else period / 4
    return f"sine:period={period:g},amplitude={amplitude:g},phase={offset:g}"


def planned(
    fleet: Fleet, start: int, sizing: str, interval: float, startup: float, ceiling: Fleet | None = None
) -> dict:
    """The planner's options: capped at ``ceiling`` (default: ``fleet``), starting at ``start``
    workers a pool (0: the cap)."""
    cap = ceiling or fleet
    start = start or max(cap.prefill, cap.decode)
    options = {
        "planner": True,
        "sizing": sizing,
        "workers": min(start, cap.decode),
        "max_workers": cap.decode,
        "adjustment_interval": interval,
        "worker_startup_secs": startup,
    }
    if fleet.prefill:
        prefill_cap = max(cap.prefill, 1)
        options |= {"prefill_workers": min(start, prefill_cap), "max_prefill_workers": prefill_cap}
    return options
