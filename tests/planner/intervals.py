"""One planner interval's observation, for the planner's tests: ten seconds at a request rate, the
fleet keeping up (every arrival finished), with the attainment and mean TTFT given."""

from __future__ import annotations

from kvmesh.planner.load import IntervalObservation


def interval(start: float, rate: float, attainment: float | None = 1.0, ttft: float = 0.0) -> IntervalObservation:
    return IntervalObservation(
        start_s=start,
        duration_s=10.0,
        requests=int(rate * 10),
        mean_input_tokens=8000,
        mean_output_tokens=150,
        prefix_hit_fraction=0.3,
        input_tokens_cv2=1.0,
        ttft_mean_ms=ttft,
        sla_attainment=attainment,
        finished=int(rate * 10),  # keeping up: no backlog
    )
