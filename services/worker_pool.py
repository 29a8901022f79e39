"""The worker pools of a ``kvmesh up`` mesh that the planner resizes (the local connector's supervisor
side): one aggregated pool, or a prefill and a decode pool when the mesh is disaggregated.

Growing starts worker processes; shrinking sends the youngest (or, with ``--shrink-handoff-blocks``,
the cheapest departure: ``kvmesh.up.departures``) SIGTERM — a worker then deregisters,
serves its open streams for its grace period, and the router continues what is left elsewhere, so
no request is lost — and keeps them in ``stopping`` until they have exited.

The planner asks over NATS request/reply with JSON: ``{"prefill": 2, "decode": 3}`` sets those pools,
``{}`` only asks; the answer always names every role, ``{"aggregated": 0, "prefill": 2, "decode": 3}``,
or ``{"error": "..."}`` when the request cannot be carried out (then nothing changed).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import structlog

from kvmesh.planner.decision import POOLS as ROLES

log = structlog.get_logger(__name__)


class Process(Protocol):
    name: str

    @property
    def pid(self) -> int | None: ...

    def start(self) -> None: ...
    def terminate(self) -> None: ...
    def exited(self) -> int | None: ...


class WorkerPool:
    """The workers of one role. Guarantees: ``size`` stays within [low, high]; a worker leaves the
    pool (and is no longer restarted) the moment it is asked to stop."""

    def __init__(
        self,
        services: list,
        workers: list,
        make_worker: Callable[[int], Process],
        low: int,
        high: int,
        role: str = "aggregated",
    ) -> None:
        self._services = services  # the supervisor's list: what is in it gets restarted when it dies
        self.workers = workers
        self._make_worker = make_worker
        self._next_index = len(workers)
        self.low, self.high = low, high
        self.role = role
        self.stopping: list[Process] = []

    @property
    def size(self) -> int:
        return len(self.workers)

    def scale_to(self, wanted: int, leaving: Sequence[Process] = ()) -> int:
        """Start or stop workers until ``wanted`` (within [low, high]) run; a shrink stops those of
        ``leaving`` first, in its order, then the youngest."""
        wanted = min(max(wanted, self.low), self.high)
        while self.size < wanted:
            worker = self._make_worker(self._next_index)
            self._next_index += 1
            worker.start()
            self.workers.append(worker)
            self._services.append(worker)
        first = [worker for worker in leaving if worker in self.workers]
        while self.size > wanted:
            # the cheapest departure named, else the youngest: the least cache to lose
            worker = first.pop(0) if first else self.workers[-1]
            self.workers.remove(worker)
            self._services.remove(worker)
            worker.terminate()
            self.stopping.append(worker)
        if self.stopping:
            self.stopping = [w for w in self.stopping if w.exited() is None]
        return self.size


class WorkerPools:
    """The mesh's pools by role. Guarantees: a scale request is checked whole before any pool
    changes, so a bad one changes nothing."""

    def __init__(self, pools: Mapping[str, WorkerPool]) -> None:
        unknown = set(pools) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown pool roles {sorted(unknown)}; roles are {', '.join(ROLES)}")
        self.pools = dict(pools)
        self.state_db: Path | None = None  # the planner's, for the run file

    @property
    def disaggregated(self) -> bool:
        return "prefill" in self.pools

    @property
    def stopping(self) -> list[Process]:
        return [worker for pool in self.pools.values() for worker in pool.stopping]

    def sizes(self) -> dict[str, int]:
        return {role: self.pools[role].size if role in self.pools else 0 for role in ROLES}

    def shrinking(self, request: bytes) -> list[str]:
        """The roles a scale request shrinks (none for a bad one)."""
        try:
            wanted = self._parse(request)
        except (ValueError, TypeError):
            return []
        return [role for role, size in wanted.items() if role in self.pools and size < self.pools[role].size]

    def answer(self, request: bytes, leaving: Mapping[str, Sequence[Process]] | None = None) -> bytes:
        """``leaving``: per role, the workers a shrink stops first (the cheapest departures)."""
        try:
            wanted = self._parse(request)
        except (ValueError, TypeError) as exc:
            return json.dumps({"error": f"bad scale request: {exc}"}).encode()
        before = self.sizes()
        for role, size in wanted.items():
            if role in self.pools:
                self.pools[role].scale_to(size, (leaving or {}).get(role, ()))
        after = self.sizes()
        if after != before:
            log.info("worker pools resized by the planner", before=before, after=after)
        return json.dumps(after).encode()

    def _parse(self, request: bytes) -> dict[str, int]:
        body = json.loads(request or b"{}")
        if not isinstance(body, dict):
            raise TypeError("expected a JSON object of pool sizes")
        wanted: dict[str, int] = {}
        for role, value in body.items():
            if role not in ROLES:
                raise ValueError(f"unknown pool {role!r}; pools are {', '.join(ROLES)}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{role}: a size is a whole number >= 0, not {value!r}")
            if role not in self.pools and value > 0:
                kind = "disaggregated (prefill and decode pools)" if self.disaggregated else "aggregated"
                raise ValueError(f"this mesh is {kind}: it has no {role} pool")
            wanted[role] = value
        return wanted
