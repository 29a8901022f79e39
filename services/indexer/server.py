"""The indexer service: a prefix index fed from JetStream, answering ``kvmesh.v1.Indexer``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import structlog

from services.common.discovery import DiscoveryWatcher, InstanceRecord, new_instance_id
from services.common.proto.kvmesh.v1 import indexer_pb2, indexer_pb2_grpc
from services.common.runtime import connect_nats
from services.common.service import registered_grpc_service, service_main
from services.common.streams import ensure_kv_events_stream
from services.indexer.config import IndexerConfig
from services.indexer.consumer import EventStreamConsumer
from services.indexer.prefix_index import PrefixIndex

log = structlog.get_logger(__name__)

MAX_QUERY_BLOCKS = 1 << 20


class IndexerServicer(indexer_pb2_grpc.IndexerServicer):
    def __init__(self, index: PrefixIndex, consumer: EventStreamConsumer) -> None:
        self.index = index
        self.consumer = consumer

    async def FindMatches(
        self, request: indexer_pb2.FindMatchesRequest, context: grpc.aio.ServicerContext
    ) -> indexer_pb2.FindMatchesResponse:
        if max(len(request.local_hashes), len(request.sequence_hashes)) > MAX_QUERY_BLOCKS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"query longer than {MAX_QUERY_BLOCKS} blocks")
        if request.sequence_hashes:
            matched = self.index.find_matches_by_sequence(request.sequence_hashes)
        else:
            matched = self.index.find_matches(request.local_hashes)
        return indexer_pb2.FindMatchesResponse(
            workers=[
                indexer_pb2.WorkerMatch(
                    worker_id=key[0], dp_rank=key[1], matched_blocks=matched.get(key, 0), total_blocks=size
                )
                for key, size in self.index.tree_sizes().items()
            ],
            applied_sequence=self.consumer.applied_sequence,
        )


async def serve(config: IndexerConfig, stop: asyncio.Event) -> None:
    instance_id = new_instance_id()
    nc = await connect_nats(config.nats_url, name=f"kvmesh-indexer-{config.replica_id}")
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    index = PrefixIndex()

    def worker_left(record: InstanceRecord) -> None:
        index.remove_worker(record.instance_id)
        log.info("dropped the blocks of a departed worker", worker_id=record.instance_id)

    workers = DiscoveryWatcher(js, config.namespace, "worker", on_removed=worker_left)
    await workers.start()
    consumer = EventStreamConsumer(js, config.namespace, config.replica_id, index)
    await consumer.start(reset=config.router_reset_states)
    servicer = IndexerServicer(index, consumer)
    try:
        async with registered_grpc_service(
            js,
            config,
            component="indexer",
            instance_id=instance_id,
            service_name=indexer_pb2.DESCRIPTOR.services_by_name["Indexer"].full_name,
            add_servicer=lambda server: indexer_pb2_grpc.add_IndexerServicer_to_server(servicer, server),
            extra={"replica_id": config.replica_id},
        ) as record:
            log.info("indexer ready", address=record.address, replica_id=config.replica_id)
            await stop.wait()
    finally:
        await consumer.stop()
        await workers.stop()
        await nc.close()


def main(argv: Sequence[str] | None = None) -> None:
    service_main(
        IndexerConfig,
        argv,
        service="indexer",
        description="Run an indexer replica: consumes KV events from JetStream, answers overlap queries.",
        serve=serve,
    )
