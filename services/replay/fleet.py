"""The replay's virtual connector: a fleet whose workers start, join after a start-up delay, drain
and stop as the planner decides, with the worker-seconds they cost; and the per-interval
observations the planner reads, taken from the replayed requests.

Each worker has a role, the pool it belongs to: ``aggregated``, or ``prefill`` / ``decode`` when
the replay disaggregates (``--prefill-workers``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.wire.disagg import MOVES_BLOCKS_KEY
from kvmesh.common.wire.worker_load import WorkerLoad
from kvmesh.planner.decision import POOLS
from kvmesh.planner.load import IntervalObservation, observe_interval


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

    def drain(
        self, count: int, role: str, now_ms: float, costs: Mapping[int, float] | None = None
    ) -> list[VirtualWorker]:
        """Drain ``count`` workers of pool ``role``, those not yet joined first, then (given ``costs``,
        each joined worker's cost of leaving by index, 0 where absent) the cheapest, then the youngest."""

        def order(w: VirtualWorker) -> tuple:
            joined = w.joins_ms <= now_ms
            return joined, (costs.get(w.index, 0) if costs is not None and joined else 0), -w.started_ms

        chosen = sorted(self.live(role), key=order)[:count]
        for worker in chosen:
            worker.draining_since_ms = now_ms
        return chosen

    def worker_seconds(self, end_ms: float) -> float:
        return sum(w.seconds(end_ms) for w in self.workers)


# The model the replay's requests and workers name (one model: the router's model filter passes all).
REPLAY_MODEL = "replay"


class RoutableWorkers:
    """The replay's discovery: the workers the router may send requests to now, as the registered
    records a live router's watcher lists (in the order they joined)."""

    def __init__(self, block_size: int, capacity_blocks: int, max_num_batched_tokens: int) -> None:
        # the mock engines move cached blocks: routers may have a prefix pulled between them
        extra = {"max_num_batched_tokens": max_num_batched_tokens, MOVES_BLOCKS_KEY: True}
        self._shape = (block_size, capacity_blocks, extra)
        self._records: dict[int, InstanceRecord] = {}

    def record(self, index: int, role: str) -> InstanceRecord:
        """The record worker ``index`` registers with in pool ``role``."""
        block_size, capacity, extra = self._shape
        return InstanceRecord(
            "worker",
            index,
            "",
            role=role,
            model=REPLAY_MODEL,
            block_size=block_size,
            capacity_blocks=capacity,
            extra=dict(extra),
        )

    def join(self, index: int, role: str) -> None:
        self._records[index] = self.record(index, role)

    def leave(self, index: int) -> InstanceRecord | None:
        return self._records.pop(index, None)

    def instances(self) -> list[InstanceRecord]:
        return list(self._records.values())

    def get(self, instance_id: int) -> InstanceRecord | None:
        return self._records.get(instance_id)

    def of_role(self, *roles: str) -> list[InstanceRecord]:
        return [r for r in self._records.values() if r.role in roles]

    def __contains__(self, index: int) -> bool:
        return index in self._records


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
