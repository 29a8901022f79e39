"""The aggregated workers of a ``kvmesh up`` mesh as a pool the planner resizes (local connector).

Growing starts worker processes; shrinking sends the youngest SIGTERM — a worker then deregisters,
serves its open streams for its grace period, and the router continues what is left elsewhere, so
no request is lost — and keeps them in ``stopping`` until they have exited.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)


class Process(Protocol):
    name: str

    def start(self) -> None: ...
    def terminate(self) -> None: ...
    def exited(self) -> int | None: ...


class WorkerPool:
    """Guarantees: ``size`` stays within [low, high]; a worker leaves the pool (and is no longer
    restarted) the moment it is asked to stop."""

    def __init__(
        self, services: list, workers: list, make_worker: Callable[[int], Process], low: int, high: int
    ) -> None:
        self._services = services  # the supervisor's list: what is in it gets restarted when it dies
        self.workers = workers
        self._make_worker = make_worker
        self._next_index = len(workers)
        self.low, self.high = low, high
        self.stopping: list[Process] = []
        self.state_db: Path | None = None  # the planner's, for the run file

    @property
    def size(self) -> int:
        return len(self.workers)

    def scale_to(self, wanted: int) -> int:
        wanted = min(max(wanted, self.low), self.high)
        while self.size < wanted:
            worker = self._make_worker(self._next_index)
            self._next_index += 1
            worker.start()
            self.workers.append(worker)
            self._services.append(worker)
        while self.size > wanted:
            worker = self.workers.pop()  # the youngest: the least cache to lose
            self._services.remove(worker)
            worker.terminate()
            self.stopping.append(worker)
        if self.stopping:
            self.stopping = [w for w in self.stopping if w.exited() is None]
        return self.size

    def answer(self, request: bytes) -> bytes:
        """The supervisor's side of the local connector: ``{"aggregated": N}`` resizes, ``{}`` asks."""
        try:
            body = json.loads(request or b"{}")
            if "aggregated" in body:
                before = self.size
                after = self.scale_to(int(body["aggregated"]))
                if after != before:
                    log.info("worker pool resized by the planner", before=before, after=after)
        except (ValueError, TypeError) as exc:
            return json.dumps({"error": f"bad scale request: {exc}"}).encode()
        return json.dumps({"aggregated": self.size}).encode()
