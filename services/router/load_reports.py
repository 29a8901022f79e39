"""The task that publishes this router's per-worker load for the planner (DESIGN §8)."""

from __future__ import annotations

import asyncio
import time

import structlog
from nats.aio.client import Client as NatsClient

from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.wire import names
from kvmesh.common.wire.worker_load import RouterLoadReport, WorkerLoad
from kvmesh.router.load_tracker import LoadTracker

log = structlog.get_logger(__name__)


def load_report(router_id: str, loads: LoadTracker, workers: DiscoveryWatcher) -> RouterLoadReport:
    """Every registered worker's predicted load now; an idle worker is reported with zeros, so the
    planner sees it too."""
    reported = loads.worker_loads()
    known = {load.worker_id for load in reported}
    idle = [WorkerLoad(r.instance_id, 0, 0, 0, 0) for r in workers.instances() if r.instance_id not in known]
    return RouterLoadReport(router_id, time.time(), tuple(reported + idle))


async def publish_worker_loads_forever(
    nc: NatsClient, namespace: str, router_id: str, loads: LoadTracker, workers: DiscoveryWatcher, period_s: float
) -> None:
    subject = names.router_load_subject(namespace)
    while True:
        await asyncio.sleep(period_s)
        report = load_report(router_id, loads, workers)
        try:
            await nc.publish(subject, report.encode())
        except Exception as exc:  # NATS down for a moment: this report is lost, the next one is not
            log.warning("worker load report not published", error=str(exc), workers=len(report.workers))
