"""Which workers a shrink stops first (``kvmesh up --planner --shrink-handoff-blocks N``): those whose
departure loses least, the hot cached blocks no other worker holds (docs/decisions/0051). A worker
that leaves then hands its hot blocks on (:mod:`kvmesh.worker.cache_moves`); the fewer only it holds,
the less there is to move and the less is lost if the move falls short."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog
from nats.aio.client import Client as NatsClient

from kvmesh.common.calling.worker_caches import departure_costs
from kvmesh.common.runtime.discovery import InstanceRecord, registered_now
from kvmesh.common.runtime.ports import pid_listening_on
from kvmesh.worker_pool import Process

log = structlog.get_logger(__name__)


async def departure_order(nc: NatsClient, namespace: str, workers: Sequence[Process], hot_blocks: int) -> list[Process]:
    """``workers`` cheapest departure first: by how many of each one's ``hot_blocks`` hottest cached
    blocks no other worker holds. A worker that cannot be asked is not ranked (the pool's own order
    then decides for it)."""
    records = await registered_now(nc.jetstream(), namespace, "worker")
    by_pid: dict[int, InstanceRecord] = {}
    for record in records:
        pid = await asyncio.to_thread(_pid_of, record)
        if pid is not None:
            by_pid[pid] = record
    ranked = [(worker, by_pid[pid]) for worker in workers if (pid := worker.pid) is not None and pid in by_pid]
    if len(ranked) < 2:
        return [worker for worker, _ in ranked]
    lost = await departure_costs([record for _, record in ranked], records, hot_blocks)
    costs = sorted(((lost[r.instance_id], worker) for worker, r in ranked if r.instance_id in lost), key=lambda p: p[0])
    log.info("departure costs", costs={worker.name: cost for cost, worker in costs})
    return [worker for _, worker in costs]


def _pid_of(record: InstanceRecord) -> int | None:
    try:
        return pid_listening_on(int(record.address.rsplit(":", 1)[1]))
    except (OSError, ValueError, LookupError):
        return None
