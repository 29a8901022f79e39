"""What the planner observes of one adjustment interval, and what it predicts for the next."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.common.core.stats import percentile
from kvmesh.common.wire.frontend_load import RequestSample
from kvmesh.common.wire.worker_load import WorkerLoad


@dataclass(frozen=True)
class IntervalObservation:
    """Requests that arrived in one interval and how the ones that finished were served."""

    start_s: float  # interval start (seconds; wall clock live, simulated time in a replay)
    duration_s: float
    requests: int  # arrivals
    mean_input_tokens: float
    mean_output_tokens: float
    prefix_hit_fraction: float  # cached prompt tokens ÷ prompt tokens
    # variance ÷ mean² of the prompt lengths: heavy tails make queues longer than their mean says
    input_tokens_cv2: float = 0.0
    ttft_mean_ms: float = 0.0
    itl_mean_ms: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p90_ms: float = 0.0
    itl_p50_ms: float = 0.0
    itl_p90_ms: float = 0.0
    workers: int = 0  # live workers at the interval's end
    # share of the requests finished in the interval that met both targets (None: none finished)
    sla_attainment: float | None = None
    finished: int = 0  # requests that ended in the interval
    # shares of the finished requests that met the TTFT target, and the ITL target, each alone
    ttft_attainment: float | None = None
    itl_attainment: float | None = None
    # the uncached prompt lengths' distribution (the prefill work each finished request brought):
    # UNCACHED_QUANTILES evenly spaced quantiles, empty when none finished
    uncached_quantiles: tuple[float, ...] = ()
    # each worker's load as the routers predicted it, averaged over the interval (live: their
    # reports on kvmesh.<ns>.metrics.router; replay: its router's tracker at the interval's end)
    worker_loads: tuple[WorkerLoad, ...] = ()
    # the uncached prompt lengths of the finished requests that missed the TTFT target: the planner
    # tells from them, with its profile, the misses no fleet could have served (miss_budget.py)
    ttft_missed_uncached: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, data: dict) -> IntervalObservation:
        """The inverse of ``dataclasses.asdict`` (what the planner's SQLite state stores)."""
        loads = tuple(WorkerLoad(**load) for load in data.get("worker_loads", ()))
        quantiles = tuple(data.get("uncached_quantiles", ()))
        missed = tuple(data.get("ttft_missed_uncached", ()))
        return cls(**{**data, "worker_loads": loads, "uncached_quantiles": quantiles, "ttft_missed_uncached": missed})

    @property
    def backlog_growth(self) -> int:
        """Arrivals the fleet did not keep up with this interval (0 when it kept up)."""
        return max(0, self.requests - self.finished)

    @property
    def request_rate(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True)
class LoadForecast:
    """The next interval's expected load."""

    request_rate: float  # requests per second
    mean_input_tokens: float
    mean_output_tokens: float
    prefix_hit_fraction: float
    input_tokens_cv2: float = 0.0
    # the uncached prompt lengths' quantiles (see IntervalObservation); empty: a gamma distribution
    # with the mean uncached length and input_tokens_cv2 stands in
    uncached_quantiles: tuple[float, ...] = ()

    @property
    def mean_uncached_tokens(self) -> float:
        return self.mean_input_tokens * (1.0 - self.prefix_hit_fraction)


UNCACHED_QUANTILES = 16


def met_targets(sample: RequestSample, ttft_target_ms: float, itl_target_ms: float) -> bool:
    """Whether one request met both targets (one with a single token has no inter-token latency)."""
    return sample.ttft_ms <= ttft_target_ms and met_itl(sample, itl_target_ms)


def met_itl(sample: RequestSample, itl_target_ms: float) -> bool:
    return math.isnan(sample.itl_ms) or sample.itl_ms <= itl_target_ms


def quantiles(values: Sequence[float], count: int = UNCACHED_QUANTILES) -> tuple[float, ...]:
    """``count`` evenly spaced quantiles of ``values`` (the (i + ½)/count ones); empty for none."""
    ordered = sorted(values)
    if not ordered:
        return ()
    return tuple(float(ordered[min(len(ordered) - 1, int((i + 0.5) / count * len(ordered)))]) for i in range(count))


def observe_interval(
    arrivals: int,
    samples: Sequence[RequestSample],
    start_s: float,
    duration_s: float,
    ttft_target_ms: float,
    itl_target_ms: float,
    workers: int = 0,
    worker_loads: Sequence[WorkerLoad] = (),
) -> IntervalObservation:
    """One interval's observation: the rate from the arrivals, everything else from the requests
    that finished in it (live, only a finished request knows its output length and latencies)."""

    def mean(values: Sequence[float]) -> float:
        finite = [v for v in values if not math.isnan(v)]
        return sum(finite) / len(finite) if finite else 0.0

    def quantile(values: Sequence[float], q: float) -> float:
        value = percentile(values, q)
        return 0.0 if math.isnan(value) else value

    def share(met: Callable[[RequestSample], bool]) -> float | None:
        return sum(map(met, samples)) / len(samples) if samples else None

    lengths = [s.input_tokens for s in samples]
    mean_length = mean(lengths)
    cv2 = mean([(n - mean_length) ** 2 for n in lengths]) / mean_length**2 if mean_length else 0.0
    prompt = sum(lengths)
    ttfts = [s.ttft_ms for s in samples]
    itls = [s.itl_ms for s in samples]
    return IntervalObservation(
        start_s=start_s,
        duration_s=duration_s,
        requests=arrivals,
        mean_input_tokens=mean_length,
        mean_output_tokens=mean([s.output_tokens for s in samples]),
        prefix_hit_fraction=sum(s.cached_tokens for s in samples) / prompt if prompt else 0.0,
        input_tokens_cv2=cv2,
        ttft_mean_ms=mean(ttfts),
        itl_mean_ms=mean(itls),
        ttft_p50_ms=quantile(ttfts, 50),
        ttft_p90_ms=quantile(ttfts, 90),
        itl_p50_ms=quantile(itls, 50),
        itl_p90_ms=quantile(itls, 90),
        workers=workers,
        worker_loads=tuple(worker_loads),
        finished=len(samples),
        sla_attainment=share(lambda s: met_targets(s, ttft_target_ms, itl_target_ms)),
        ttft_attainment=share(lambda s: s.ttft_ms <= ttft_target_ms),
        itl_attainment=share(lambda s: met_itl(s, itl_target_ms)),
        uncached_quantiles=quantiles([max(0, s.input_tokens - s.cached_tokens) for s in samples]),
        ttft_missed_uncached=tuple(
            max(0, s.input_tokens - s.cached_tokens) for s in samples if s.ttft_ms > ttft_target_ms
        ),
    )
