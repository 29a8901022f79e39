"""The replay's virtual connector: a fleet whose workers start, join after a start-up delay, drain
and stop as the planner decides, with the worker-seconds they cost; and the per-interval
observations the planner reads, taken from the replayed requests.

Each worker has a role, the pool it belongs to: ``aggregated``, or ``prefill`` / ``decode`` when
the replay disaggregates (``--prefill-workers``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.common.wire.worker_load import WorkerLoad
from kvmesh.planner.load import IntervalObservation, observe_interval
from kvmesh.planner.planner import POOLS


@dataclass
class VirtualWorker:
    index: int
    role: str  # one of POOLS
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

    def start(self, index: int, role: str, now_ms: float, immediately: bool = False) -> VirtualWorker:
        if role not in POOLS:
            raise ValueError(f"unknown pool {role!r}; one of {', '.join(POOLS)}")
        worker = VirtualWorker(index, role, now_ms, now_ms if immediately else now_ms + self.startup_ms)
        self.workers.append(worker)
        return worker

    def live(self, role: str | None = None) -> list[VirtualWorker]:
        """Started and not draining (in pool ``role``, or in any): the pool size the planner manages."""
        return [w for w in self.workers if w.draining_since_ms is None and role in (None, w.role)]

    def drain(self, count: int, role: str, now_ms: float) -> list[VirtualWorker]:
        """Drain ``count`` workers of pool ``role``, those not yet joined first, then the youngest."""
        chosen = sorted(self.live(role), key=lambda w: (w.joins_ms <= now_ms, -w.started_ms))[:count]
        for worker in chosen:
            worker.draining_since_ms = now_ms
        return chosen

    def worker_seconds(self, end_ms: float) -> float:
        return sum(w.seconds(end_ms) for w in self.workers)


@dataclass
class IntervalRecorder:
    """The planner's observation of [start, end) of a replay: the same function the live planner
    applies to the frontends' reports, fed with the replayed requests."""

    ttft_target_ms: float
    itl_target_ms: float

    def observe(
        self, records: Sequence, start_ms: float, end_ms: float, workers: int, worker_loads: Sequence[WorkerLoad] = ()
    ) -> IntervalObservation:
        arrivals = sum(1 for r in records if start_ms <= r.arrival_ms < end_ms)
        samples = [r.sample() for r in records if start_ms <= r.last_token_ms < end_ms]
        return observe_interval(
            arrivals,
            samples,
            start_ms / 1000.0,
            (end_ms - start_ms) / 1000.0,
            self.ttft_target_ms,
            self.itl_target_ms,
            workers,
            worker_loads,
        )
