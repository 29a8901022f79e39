"""What the planner observes of one adjustment interval, and what it predicts for the next."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def mean_uncached_tokens(self) -> float:
        return self.mean_input_tokens * (1.0 - self.prefix_hit_fraction)
