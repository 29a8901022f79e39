"""The router service: ``kvmesh router``. Wires discovery, the indexer client, replica sync and the
servicer together; the decision lives in :mod:`~kvmesh.router.routing`, the request path in
:mod:`~kvmesh.router.servicer`."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

import structlog
from prometheus_client import Gauge

from kvmesh.common.proto.kvmesh.v1 import router_pb2, router_pb2_grpc
from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.rpc.stream_sessions import StreamSessions, open_worker_stream
from kvmesh.common.runtime.discovery import DiscoveryWatcher, InstanceRecord, new_instance_id
from kvmesh.common.runtime.heap import freeze_startup_heap
from kvmesh.common.runtime.metrics import MetricsEndpoint
from kvmesh.common.runtime.service import ServiceStack, service_main
from kvmesh.router.config import RouterConfig
from kvmesh.router.fleet_checks import FleetChecks
from kvmesh.router.indexer_client import IndexerClient
from kvmesh.router.load_reports import publish_worker_loads_forever
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.replica_sync import ReplicaSync
from kvmesh.router.request_queue import RouterQueue
from kvmesh.router.routing import Router
from kvmesh.router.servicer import RouterServicer

log = structlog.get_logger(__name__)
FLEET_CHECK_SECS = 2.0


async def expire_forever(router: Router) -> None:
    """Forget requests whose free was lost (a replica or a stream that vanished without a word)."""
    while True:
        await asyncio.sleep(min(10.0, router.config.request_timeout_secs / 4))
        router.expire_stale()


async def check_fleet_forever(router: Router, indexers: DiscoveryWatcher) -> None:
    """Look for a misconfigured fleet every few seconds (kvmesh.router.fleet_checks)."""
    while True:
        await asyncio.sleep(FLEET_CHECK_SECS)
        router.checks.check(router.workers.instances(), len(indexers.instances()), router.indexers)


async def nudge_queue_forever(queue: RouterQueue) -> None:
    """Give the router queue a try every second while requests wait: capacity may also come back
    without a free (a busy threshold met by load that a lost report still counts expires later)."""
    while True:
        await asyncio.sleep(1.0)
        if queue.depth():
            queue.capacity_freed()


async def serve(config: RouterConfig, stop: asyncio.Event) -> None:
    instance_id = new_instance_id()
    async with ServiceStack() as stack:
        nc = await stack.nats(config, f"kvmesh-router-{instance_id}")
        js = nc.jetstream()
        channels = ChannelPool()
        stack.push_async_callback(channels.close)
        sessions = StreamSessions(channels, open_worker_stream)
        stack.push_async_callback(sessions.close)  # before the channels (callbacks run last-in first)
        routers: list[Router] = []  # the router exists once the watchers it reads do

        async def worker_left(record: InstanceRecord) -> None:
            for router in routers:
                router.worker_left(record)
            sessions.drop(record.address)
            await channels.drop(record.address)

        def worker_joined(_record: InstanceRecord) -> None:
            for router in routers:
                router.on_capacity()  # capacity for the queue

        workers = await stack.start(
            DiscoveryWatcher(js, config.namespace, "worker", on_added=worker_joined, on_removed=worker_left)
        )
        indexer_clients: list[IndexerClient] = []  # as routers: the client exists once its watcher does

        def indexer_left(record: InstanceRecord) -> None:
            for client in indexer_clients:
                client.forget(record.address)

        indexers = await stack.start(DiscoveryWatcher(js, config.namespace, "indexer", on_removed=indexer_left))
        rng = random.Random(config.seed)
        indexer_client = IndexerClient(indexers, channels, config.indexer_timeout_ms / 1000, rng)
        indexer_clients.append(indexer_client)
        stack.push_async_callback(indexer_client.close)  # before the channels, like the sessions
        # the metrics read the router's picture and sync, which exist once the router does
        metrics = RouterMetrics(lambda: router.loads.pictures(), lambda: len(router.sync.peers()) if router.sync else 0)
        queue = RouterQueue(config.queue_config(), metrics.queue, time.monotonic)
        router = Router(
            config,
            workers,
            indexer_client,
            router_id=str(instance_id),
            rng=rng,
            checks=FleetChecks(metrics.findings, config.kv_events, time.monotonic),
            on_capacity=queue.capacity_freed,
        )
        routers.append(router)
        if config.router_replica_sync:
            sync = ReplicaSync(
                nc, config.namespace, router.router_id, router.apply_remote, router.picture.forget_router
            )
            router.share_with(await stack.start(sync))
        stack.task(expire_forever(router), "expire-requests")
        stack.task(
            publish_worker_loads_forever(
                nc, config.namespace, router.router_id, router.loads, workers, config.load_report_secs
            ),
            "publish-worker-loads",
        )
        split_overhead = Gauge(
            "kvmesh_router_split_overhead_ms",
            "what a prefill/decode split adds to time to first token beyond its prefill, as measured (docs/decisions/"
            "0037); a split is made only where it is predicted to pay",
            registry=metrics.registry,
        )
        split_overhead.set_function(lambda: router.split_overhead.estimate(router.clock()))
        endpoint = MetricsEndpoint(config, metrics.registry)
        stack.push_async_callback(endpoint.close)
        servicer = RouterServicer(router, channels, sessions, metrics, queue)
        stack.task(nudge_queue_forever(servicer.queue), "nudge-queue")
        stack.task(check_fleet_forever(router, indexers), "check-fleet")
        stack.callback(servicer.disaggregation.close)
        registration = await stack.grpc_service(
            js,
            config,
            component="router",
            instance_id=instance_id,
            service_name=router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
            add_servicer=lambda server: router_pb2_grpc.add_RouterServicer_to_server(servicer, server),
            extra={
                "mode": config.router_mode,
                "replica_sync": config.router_replica_sync,
                **endpoint.discovery_extra(),
            },
        )
        record = registration.record
        log.info("router ready", address=record.address, mode=config.router_mode)
        freeze_startup_heap()
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> None:
    service_main(
        RouterConfig,
        argv,
        service="router",
        description=(
            "Run a router (kvmesh.v1.Router): sends each request to the cheapest worker; while prefill workers "
            "are registered, splits requests into a remote prefill and a decode (disaggregation)."
        ),
        serve=serve,
    )
