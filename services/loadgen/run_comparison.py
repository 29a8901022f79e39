"""How far apart two setups' repeated load runs are: a bootstrap interval for a difference.

A setup run several times (``bench.vllm_bench --repeats``) gives several runs of per-request rows
(the load generator's ``per_request``). A difference between two setups' pooled figures (cached
share, TTFT p50 or p99) is read against how much those figures move when the same setup runs again.
The interval here resamples at both levels: the runs (with replacement), then each drawn run's
requests (with replacement). Why both: requests of one run share the machine's state over that run
(on 2 cores one run's p99 moved by 40% from the next), so resampling requests alone would call
differences certain that the next run would not repeat.

With three runs a setup the interval is rough (a run drawn twice counts twice), and it is read as
that: an interval that contains 0 says the runs cannot tell the setups apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Row = Mapping[str, object]
# A figure of pooled requests: the prompt tokens, cached tokens and TTFTs (s; NaN where a completed
# request streamed no token) of those that completed.
Figure = Callable[[np.ndarray, np.ndarray, np.ndarray], float]


def cached_share(prompt: np.ndarray, cached: np.ndarray, ttft_s: np.ndarray) -> float:
    """Cached prompt tokens over all prompt tokens."""
    total = prompt.sum()
    return float(cached.sum() / total) if total else 0.0


def ttft_percentile(q: float) -> Figure:
    """The TTFT's ``q``-th percentile in ms (numpy's linear method, as the reports' own)."""

    def figure(prompt: np.ndarray, cached: np.ndarray, ttft_s: np.ndarray) -> float:
        timed = ttft_s[~np.isnan(ttft_s)]
        return float(np.percentile(timed, q) * 1000.0) if timed.size else float("nan")

    return figure


FIGURES: dict[str, Figure] = {
    "cached share": cached_share,
    "TTFT p50 ms": ttft_percentile(50),
    "TTFT p99 ms": ttft_percentile(99),
}


@dataclass(frozen=True)
class Difference:
    """``a``'s figure minus ``b``'s over their pooled runs, and the ``level`` interval around it."""

    name: str
    value: float
    low: float
    high: float
    level: float

    @property
    def tells_apart(self) -> bool:
        """Whether the interval leaves 0 out: the runs tell the setups apart on this figure."""
        return self.low > 0 or self.high < 0

    def __str__(self) -> str:
        digits = 3 if "share" in self.name else 0
        return f"{self.name} {self.value:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


class _Runs:
    """One setup's runs as columns: each run's completed requests' prompt, cached and TTFT arrays."""

    def __init__(self, runs: Sequence[Sequence[Row]]) -> None:
        if not runs:
            raise ValueError("a setup needs at least one run")
        self.columns: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for rows in runs:
            done = [row for row in rows if row.get("error") is None]
            if not done:
                raise ValueError("a run has no completed request")
            self.columns.append(
                (
                    np.array([row["prompt_tokens"] for row in done], dtype=np.float64),
                    np.array([row["cached_tokens"] for row in done], dtype=np.float64),
                    np.array([row["ttft_s"] if row["ttft_s"] is not None else np.nan for row in done]),
                )
            )

    def pooled(self, picks: Sequence[tuple[int, np.ndarray | None]]) -> tuple[np.ndarray, ...]:
        """The requests of the runs picked, each run's rows taken at the given indices (None: all)."""
        parts = [tuple(column if rows is None else column[rows] for column in self.columns[run]) for run, rows in picks]
        return tuple(np.concatenate([part[i] for part in parts]) for i in range(3))

    def whole(self) -> tuple[np.ndarray, ...]:
        return self.pooled([(run, None) for run in range(len(self.columns))])

    def draw(self, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        """A resample: as many runs as there are, drawn with replacement, each one's rows resampled."""
        runs = rng.integers(0, len(self.columns), size=len(self.columns))
        return self.pooled(
            [(int(run), rng.integers(0, self.columns[run][0].size, self.columns[run][0].size)) for run in runs]
        )


def differences(
    a: Sequence[Sequence[Row]],
    b: Sequence[Sequence[Row]],
    figures: Mapping[str, Figure] = FIGURES,
    draws: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> list[Difference]:
    """For each figure, ``a``'s pooled value minus ``b``'s, with the central ``level`` interval of that
    difference over ``draws`` two-level resamples (runs, then requests). ``a`` and ``b``: each a
    setup's runs, a run being its per-request rows (``prompt_tokens``, ``cached_tokens``, ``ttft_s``,
    ``error``). Deterministic for a ``seed``. Raises ValueError for a setup with no run, or a run with
    no completed request."""
    if draws < 1 or not 0 < level < 1:
        raise ValueError("draws must be >= 1 and level within (0, 1)")
    first, second = _Runs(a), _Runs(b)
    rng = np.random.default_rng(seed)
    samples = {name: np.empty(draws) for name in figures}
    for i in range(draws):
        drawn_a, drawn_b = first.draw(rng), second.draw(rng)
        for name, figure in figures.items():
            samples[name][i] = figure(*drawn_a) - figure(*drawn_b)
    whole_a, whole_b = first.whole(), second.whole()
    tail = (1 - level) / 2 * 100
    result = []
    for name, figure in figures.items():
        low, high = np.percentile(samples[name], [tail, 100 - tail])
        result.append(Difference(name, figure(*whole_a) - figure(*whole_b), float(low), float(high), level))
    return result
