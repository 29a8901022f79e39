"""Each worker's load as a router predicts it, published for the planner (msgpack on core NATS).

Every few seconds a router sends what its load tracker holds per worker: requests in flight, uncached
prompt tokens still to prefill, and KV tokens the requests hold. Router replicas share their view
(replica sync), so each report already covers every router's requests; the planner averages one
router's reports over its interval and takes, per worker, the largest of the routers' averages (a
replica that missed a sync message shows less, never more).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgpack

VERSION = 1


class WorkerLoadError(ValueError):
    """A message on the router load subject that is not a report this version reads."""


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: int
    dp_rank: int
    requests: float  # in flight (prefilling or decoding)
    prefill_tokens: float  # uncached prompt tokens routed but not yet prefilled
    kv_tokens: float  # KV the requests hold (shared prefixes counted once)


@dataclass(frozen=True)
class RouterLoadReport:
    source: str  # the router's id
    at_s: float  # wall clock
    workers: tuple[WorkerLoad, ...] = field(default_factory=tuple)

    def encode(self) -> bytes:
        rows = [[w.worker_id, w.dp_rank, w.requests, w.prefill_tokens, w.kv_tokens] for w in self.workers]
        return msgpack.packb([VERSION, self.source, self.at_s, rows])

    @classmethod
    def decode(cls, data: bytes) -> RouterLoadReport:
        try:
            version, source, at_s, rows = msgpack.unpackb(data)
            if version != VERSION:
                raise WorkerLoadError(f"router load report version {version}, expected {VERSION}")
            workers = tuple(
                WorkerLoad(int(worker), int(rank), float(requests), float(prefill), float(kv))
                for worker, rank, requests, prefill, kv in rows
            )
            return cls(str(source), float(at_s), workers)
        except WorkerLoadError:
            raise
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise WorkerLoadError(f"not a router load report: {exc}") from exc


def mean_loads(snapshots: Sequence[Iterable[WorkerLoad]]) -> list[WorkerLoad]:
    """Each worker's mean over ``snapshots``; a worker missing from a snapshot had no load in it."""
    totals: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for snapshot in snapshots:
        for load in snapshot:
            total = totals[(load.worker_id, load.dp_rank)]
            total[0] += load.requests
            total[1] += load.prefill_tokens
            total[2] += load.kv_tokens
    n = max(len(snapshots), 1)
    return [WorkerLoad(w, r, t[0] / n, t[1] / n, t[2] / n) for (w, r), t in sorted(totals.items())]


def merge_router_reports(reports: Iterable[RouterLoadReport]) -> tuple[WorkerLoad, ...]:
    """One interval's per-worker load from every router's reports: each router's mean, then per
    worker the largest of the routers' means."""
    by_router: dict[str, list[tuple[WorkerLoad, ...]]] = defaultdict(list)
    for report in reports:
        by_router[report.source].append(report.workers)
    merged: dict[tuple[int, int], WorkerLoad] = {}
    for snapshots in by_router.values():
        for load in mean_loads(snapshots):
            key = (load.worker_id, load.dp_rank)
            seen = merged.get(key)
            if seen is None or load.requests + load.kv_tokens > seen.requests + seen.kv_tokens:
                merged[key] = load
    return tuple(merged[key] for key in sorted(merged))
