"""A poison message on the KV event stream (garbage bytes, a batch with a broken field) is counted
and skipped by an indexer replica, which goes on applying the real events after it and holds
exactly what the worker holds."""

from __future__ import annotations

import msgpack
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2_grpc
from kvmesh.common.rpc.grpc_server import channel_to
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.wire import names
from kvmesh.devtools.index_truth import converged
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import metric_value, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "poison"
POISON = [
    b"\x00\xff garbage",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"worker_id": 7, "events": [{"event_id": 0, "data": None}]}),
    msgpack.packb({"worker_id": float("inf"), "events": []}),
]


def malformed_count(metrics_address: str) -> float:
    return metric_value(metrics_address, "kvmesh_indexer_malformed_messages_total")


async def test_poison_messages_are_counted_and_skipped(nats_url: str, nc: NatsClient):
    common = ["--nats-url", nats_url, "--namespace", NAMESPACE]
    workers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "worker")
    indexers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "indexer")
    await workers.start()
    await indexers.start()
    async with (
        running(worker_server.serve, service_config(WorkerConfig, [*common, "--speedup-ratio", "100"])),
        running(indexer_server.serve, service_config(IndexerConfig, [*common, "--replica-id", "p"])),
    ):
        await wait_until_async(lambda: workers.instances() and indexers.instances(), what="worker and replica up")
        js = nc.jetstream()
        for payload in POISON:
            await js.publish(names.kv_events_subject(NAMESPACE, 7), payload)
        async with channel_to(workers.instances()[0].address) as channel:
            request = common_pb2.PreprocessedRequest(request_id="after", token_ids=list(range(64)))
            request.stop.max_tokens = 2
            [_ async for _ in worker_pb2_grpc.WorkerStub(channel).Generate(request)]
        indexer = indexers.instances()[0]
        await wait_until_async(
            lambda: converged(workers, indexer.address), what="the replica holds the worker's blocks"
        )
        assert malformed_count(indexer.extra["metrics"]) == len(POISON)
    await workers.stop()
    await indexers.stop()
