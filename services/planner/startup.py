"""How long a worker takes from being asked for to serving, measured from the planner's own
growths rather than assumed: it sets how far ahead the planner sizes and how long it waits before
growing again on a miss."""

from __future__ import annotations

from dataclasses import dataclass, field

STARTUPS_KEPT = 3  # a start-up is planned for as the slowest of the last few measured


@dataclass
class StartupMeter:
    """Guarantees: :attr:`seconds` is ``guess_s`` until a growth has been served, then the slowest
    of the last ``STARTUPS_KEPT`` measured; a measurement runs from the decision (or look) that asked
    for more workers to the end of the first interval, or the first look, whose count of serving
    workers reached it (an upper bound, within one interval, or one look's spacing with looks); a
    growth the planner takes back before it is served is not measured. Deterministic in its inputs
    (a resumed planner, which replays decisions and not looks, measures what its decisions saw)."""

    guess_s: float
    _awaited: list[tuple[float, int]] = field(default_factory=list)  # (asked at, workers wanted)
    _measured: list[float] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return max(self._measured) if self._measured else self.guess_s

    def decided(self, now_s: float, current: int, target: int) -> None:
        """A decision at ``now_s`` set the fleet from ``current`` to ``target`` workers."""
        self._awaited = [(at, wanted) for at, wanted in self._awaited if wanted <= target]
        if target > current:
            self._awaited.append((now_s, target))

    def observed(self, end_s: float, serving: int) -> None:
        """``serving`` workers served at ``end_s`` (0: the observation did not count them)."""
        if not serving:
            return
        served = [(at, wanted) for at, wanted in self._awaited if serving >= wanted]
        for at, _wanted in served:
            self._measured = [*self._measured, max(0.0, end_s - at)][-STARTUPS_KEPT:]
        self._awaited = [pending for pending in self._awaited if pending not in served]
