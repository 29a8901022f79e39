"""The replay's virtual connector: a fleet whose workers start, join after a start-up delay, drain
and stop as the planner decides, with the worker-seconds they cost; and the per-interval
observations the planner reads, taken from the replayed requests."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.planner.load import IntervalObservation
from kvmesh.replay.report import percentile, sla_attainment


@dataclass
class VirtualWorker:
    index: int
    started_ms: float  # when it was started: it costs from here
    joins_ms: float  # when it takes requests
    draining_since_ms: float | None = None
    stopped_ms: float | None = None

    def seconds(self, end_ms: float) -> float:
        stop = self.stopped_ms if self.stopped_ms is not None else end_ms
        return max(0.0, stop - self.started_ms) / 1000.0


@dataclass
class VirtualFleet:
    """Guarantees: a worker takes requests only between joining and draining; it stops (and stops
    costing) only once its engine has nothing left to run."""

    startup_ms: float
    workers: list[VirtualWorker] = field(default_factory=list)
    timeline: list[dict[str, float]] = field(default_factory=list)

    def start(self, index: int, now_ms: float, immediately: bool = False) -> VirtualWorker:
        worker = VirtualWorker(index, now_ms, now_ms if immediately else now_ms + self.startup_ms)
        self.workers.append(worker)
        return worker

    def live(self) -> list[VirtualWorker]:
        """Started and not draining: the pool size the planner manages."""
        return [w for w in self.workers if w.draining_since_ms is None]

    def drain(self, count: int, now_ms: float) -> list[VirtualWorker]:
        """Drain ``count`` workers, those not yet joined first, then the youngest."""
        chosen = sorted(self.live(), key=lambda w: (w.joins_ms <= now_ms, -w.started_ms))[:count]
        for worker in chosen:
            worker.draining_since_ms = now_ms
        return chosen

    def worker_seconds(self, end_ms: float) -> float:
        return sum(w.seconds(end_ms) for w in self.workers)


@dataclass
class IntervalRecorder:
    """Builds the planner's observation of [start, end) from the replay's request records."""

    ttft_target_ms: float
    itl_target_ms: float

    def observe(self, records: Sequence, start_ms: float, end_ms: float, workers: int) -> IntervalObservation:
        arrived = [r for r in records if start_ms <= r.arrival_ms < end_ms]
        first_tokens = [r for r in records if start_ms <= r.first_token_ms < end_ms]
        ended = [r for r in records if start_ms <= r.last_token_ms < end_ms]
        finished = [r for r in ended if r.tokens > 1]
        prompt = sum(r.input_length for r in first_tokens)
        ttfts = [r.ttft_ms for r in first_tokens]
        itls = [r.tpot_ms for r in finished]

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else 0.0

        lengths = [r.input_length for r in arrived]
        mean_length = mean(lengths)
        cv2 = mean([(n - mean_length) ** 2 for n in lengths]) / mean_length**2 if mean_length else 0.0

        def p(values: list[float], q: float) -> float:
            value = percentile(values, q) if values else 0.0
            return 0.0 if math.isnan(value) else value

        return IntervalObservation(
            start_s=start_ms / 1000.0,
            duration_s=(end_ms - start_ms) / 1000.0,
            requests=len(arrived),
            mean_input_tokens=mean_length,
            mean_output_tokens=mean([r.output_length for r in arrived]),
            prefix_hit_fraction=sum(r.cached_tokens for r in first_tokens) / prompt if prompt else 0.0,
            input_tokens_cv2=cv2,
            ttft_mean_ms=mean(ttfts),
            itl_mean_ms=mean(itls),
            ttft_p50_ms=p(ttfts, 50),
            ttft_p90_ms=p(ttfts, 90),
            itl_p50_ms=p(itls, 50),
            itl_p90_ms=p(itls, 90),
            workers=workers,
            sla_attainment=sla_attainment(ended, self.ttft_target_ms, self.itl_target_ms) if ended else None,
        )
