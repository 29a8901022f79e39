"""Summary figures of a replay: prefix reuse, TTFT, TPOT, ITL, end-to-end latency, throughput."""

from __future__ import annotations

import csv
import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.common.core.stats import percentile
from kvmesh.planner.load import met_targets
from kvmesh.replay.config import TOO_LONG

if TYPE_CHECKING:  # the simulator imports the planner, which this module imports too
    from kvmesh.replay.config import RequestRecord

__all__ = [
    "closest_margin",
    "forecast_errors",
    "margins",
    "percentile",
    "plot_timeline",
    "pooled_margins",
    "shortfalls",
    "sla_attainment",
    "summarise",
    "write_csv",
]


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _distribution(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": _mean(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def summarise(records: Sequence[RequestRecord]) -> dict[str, Any]:
    done = [r for r in records if r.tokens == r.output_length]
    prompt_tokens = sum(r.input_length for r in records if not r.refused)  # a refused prompt was never served
    cached = sum(r.cached_tokens for r in done)
    start = min((r.arrival_ms for r in records), default=0.0)
    end = max((r.last_token_ms for r in done), default=start)
    duration_s = (end - start) / 1000
    output_tokens = sum(r.tokens for r in done)
    itl = [gap for r in done for gap in r.inter_token_ms]
    return {
        "requests": len(records),
        "completed": len(done),
        "prefix_reuse": cached / prompt_tokens if prompt_tokens else 0.0,
        # the part of that reuse pulled from another worker's cache (decision 70), not found in its own
        "pulled_share": sum(r.pulled_tokens for r in done) / prompt_tokens if prompt_tokens else 0.0,
        "ttft_ms": _distribution([r.ttft_ms for r in done]),
        "tpot_ms": _distribution([r.tpot_ms for r in done]),
        "itl_ms": _distribution(itl),
        "e2e_ms": {"mean": _mean([r.e2e_ms for r in done]), "p99": percentile([r.e2e_ms for r in done], 99)},
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else 0.0,
        "simulated_duration_s": duration_s,
        **_kv_sources(records),
        **_steered(records),
        **_queue(records),
    }


def _steered(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """How many requests a rule moved off the worker their cost rated cheapest, by rule (decisions 63, 67)."""
    rules = _tally(r.steered_by for r in records)
    return {"steered": rules} if rules else {}


def _queue(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """With the router queue: refusals, and per priority class the wait and the TTFT (from arrival)."""
    if not any(r.refused or r.queued_ms or r.priority != "normal" for r in records):
        return {}
    by_class: dict[str, Any] = {}
    for priority in sorted({r.priority for r in records}):
        mine = [r for r in records if r.priority == priority]
        served = [r for r in mine if not r.refused and r.tokens == r.output_length]
        by_class[priority] = {
            "requests": len(mine),
            "refused": {
                reason: sum(1 for r in mine if r.refused == reason) for reason in ("full", "timeout", "busy", TOO_LONG)
            },
            "queued_ms": _distribution([r.queued_ms for r in served]),
            "ttft_ms": _distribution([r.ttft_ms for r in served]),
        }
    return {"refused": sum(1 for r in records if r.refused), "by_priority": by_class}


def _kv_sources(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """With prefill workers: how many requests prefilled remotely, and locally for which reason."""
    sources = _tally(r.kv_source for r in records)
    return {"prefills": sources} if sources else {}


def _tally(labels: Iterable[str]) -> dict[str, int]:
    """How often each non-empty label occurs, in label order."""
    return dict(sorted(Counter(label for label in labels if label).items()))


def write_csv(records: Sequence[RequestRecord], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "index",
                "arrival_ms",
                "worker",
                "prefill_worker",
                "input_length",
                "output_length",
                "cached_tokens",
                "ttft_ms",
                "tpot_ms",
                "e2e_ms",
            ]
        )
        for r in records:
            writer.writerow(
                [
                    r.index,
                    f"{r.arrival_ms:.3f}",
                    r.worker,
                    r.prefill_worker,
                    r.input_length,
                    r.output_length,
                    r.cached_tokens,
                    f"{r.ttft_ms:.3f}",
                    f"{r.tpot_ms:.3f}",
                    f"{r.e2e_ms:.3f}",
                ]
            )


def sla_attainment(records: Sequence[RequestRecord], ttft_target_ms: float, itl_target_ms: float) -> float:
    """Share of requests whose TTFT and mean inter-token latency both met their targets."""
    if not records:
        return math.nan

    return sum(met_targets(r.sample(), ttft_target_ms, itl_target_ms) for r in records) / len(records)


def plot_timeline(timeline: Sequence[dict[str, float]], path: Path, title: str) -> None:
    """Pool size and request rate over time (the planner's view), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p["t_s"] for p in timeline]
    figure, workers_axis = plt.subplots(figsize=(9, 4))
    workers_axis.step(t, [p["workers"] for p in timeline], where="post", label="live workers", color="tab:blue")
    workers_axis.step(t, [p["target"] for p in timeline], where="post", label="planner target", color="tab:cyan")
    workers_axis.set_xlabel("simulated time (s)")
    workers_axis.set_ylabel("workers")
    rate_axis = workers_axis.twinx()
    rate_axis.plot(t, [p["observed_rate"] for p in timeline], label="observed rate", color="tab:orange")
    rate_axis.plot(t, [p["predicted_rate"] for p in timeline], label="predicted rate", color="tab:red", ls="--")
    rate_axis.set_ylabel("requests / s")
    lines = workers_axis.get_legend_handles_labels()[0] + rate_axis.get_legend_handles_labels()[0]
    labels = workers_axis.get_legend_handles_labels()[1] + rate_axis.get_legend_handles_labels()[1]
    workers_axis.legend(lines, labels, loc="upper left", fontsize="small")
    workers_axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def forecast_errors(timeline: Sequence[dict[str, float]]) -> tuple[float | None, float | None, float | None]:
    """How far each step's rate forecast was from the rate observed in the interval it was for (the
    step ``horizon`` steps on): the mean relative error's size, and its mean sign while the load rose
    and while it fell (positive: it foresaw too much). Intervals with no arrivals are left out."""
    errors: list[float] = []
    rising: list[float] = []
    falling: list[float] = []
    for i, point in enumerate(timeline):
        later = i + int(point.get("horizon", 1))
        if later >= len(timeline) or timeline[later]["observed_rate"] <= 0:
            continue
        observed = timeline[later]["observed_rate"]
        error = (point["predicted_rate"] - observed) / observed
        errors.append(abs(error))
        (rising if observed > point["observed_rate"] else falling).append(error)

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    return mean(errors), mean(rising), mean(falling)


def shortfalls(candidate: Sequence[float], rivals: Sequence[Sequence[float]]) -> list[str]:
    """The columns where ``candidate`` (prefix reuse, TTFT p50, TTFT p99 in ms) falls short of the best
    of ``rivals``: less reuse than the most any keeps, a longer p50 or p99 than the shortest any has.
    Compared as reports print them (reuse to 0.001, times to the ms), so a tie as printed matches.
    Empty: the candidate matches or beats every rival in every column (issue 45's first item)."""
    if not rivals:
        raise ValueError("no rival to compare with")
    reuse, p50, p99 = round(candidate[0], 3), round(candidate[1]), round(candidate[2])
    short = ["reuse"] if reuse < max(round(r[0], 3) for r in rivals) else []
    short += ["p50"] if p50 > min(round(r[1]) for r in rivals) else []
    return short + (["p99"] if p99 > min(round(r[2]) for r in rivals) else [])


COLUMNS = ("reuse", "p50", "p99")


def margins(candidate: Sequence[float], rivals: Sequence[Sequence[float]]) -> list[float]:
    """Per column (prefix reuse, TTFT p50, TTFT p99 in ms), ``candidate``'s margin against the best of
    ``rivals`` as a share of that best: positive ahead (more reuse, a shorter time), negative behind.
    At full precision, unlike :func:`shortfalls`; infinite where the best is 0."""
    if not rivals:
        raise ValueError("no rival to compare with")
    best_reuse = max(r[0] for r in rivals)
    each = [(candidate[0] - best_reuse) / best_reuse if best_reuse else math.inf]
    for column in (1, 2):
        best = min(r[column] for r in rivals)
        each.append((best - candidate[column]) / best if best else math.inf)
    return each


def closest_margin(candidate: Sequence[float], rivals: Sequence[Sequence[float]]) -> tuple[str, float]:
    """The column where ``candidate`` is nearest the best of ``rivals``, and its :func:`margins` there.

    Why: the verdict compares figures as printed, so a median 0.9 ms behind on one replay seed and
    0.1 ms ahead on another reads as a win on both seeds' mean; the margin shows how firm each is."""
    each = margins(candidate, rivals)
    nearest = min(range(3), key=each.__getitem__)
    return COLUMNS[nearest], each[nearest]


@dataclass(frozen=True)
class PooledMargin:
    """One column's :func:`margins` over many traces: their mean, a ``level`` interval around it that
    resamples the traces, and on how many traces the candidate is ahead and behind."""

    column: str
    mean: float
    low: float
    high: float
    ahead: int
    behind: int
    level: float = 0.95

    def __str__(self) -> str:
        return (
            f"{self.column} {self.mean:+.2%} [{self.low:+.2%}, {self.high:+.2%}], "
            f"ahead on {self.ahead}, behind on {self.behind}"
        )


def pooled_margins(
    traces: Sequence[tuple[Sequence[float], Sequence[Sequence[float]]]],
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> list[PooledMargin]:
    """Per column, the (candidate, rivals) pairs' :func:`margins` over ``traces`` pooled
    (:class:`PooledMargin`; a trace whose best is 0 is left out of that column); the ``level`` interval
    resamples the traces with a fixed ``seed``, so the same figures print the same interval.

    Why: :func:`shortfalls` judges each trace alone, and a median a few tenths of a millisecond behind
    its best rival on one trace and as far ahead on the next decides it by rounding. Over many traces
    the question is whether the candidate is behind on the whole: an interval holding 0 says these
    traces cannot tell it from its best rival on that column."""
    if not traces:
        raise ValueError("no trace to pool")
    columns = list(zip(*(margins(candidate, rivals) for candidate, rivals in traces), strict=True))
    rng = random.Random(seed)
    pooled = []
    for name, values in zip(COLUMNS, columns, strict=True):
        finite = [value for value in values if math.isfinite(value)]
        if not finite:
            continue
        means = sorted(sum(rng.choices(finite, k=len(finite))) / len(finite) for _ in range(resamples))
        tail = int(resamples * (1.0 - level) / 2)
        pooled.append(
            PooledMargin(
                name,
                sum(finite) / len(finite),
                means[tail],
                means[resamples - 1 - tail],
                sum(value > 0 for value in finite),
                sum(value < 0 for value in finite),
                level,
            )
        )
    return pooled
