"""The indexer service: a prefix index fed from JetStream, answering ``kvmesh.v1.Indexer``.

Around the sans-I/O :class:`PrefixIndex` it runs: the durable event consumer (restored from the
latest snapshot), gap recovery from workers' dumps, the snapshotter, a reconciler that drops workers
absent from discovery, and a Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import structlog
from nats.js import JetStreamContext
from prometheus_client import Histogram

from kvmesh.common.core.index_answer import answer_query
from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.proto.kvmesh.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh.common.rpc.grpc_errors import refuse
from kvmesh.common.runtime.discovery import DiscoveryWatcher, InstanceRecord, new_instance_id
from kvmesh.common.runtime.heap import freeze_startup_heap
from kvmesh.common.runtime.jetstream_metrics import JetStreamCollector
from kvmesh.common.runtime.jetstream_state import when_jetstream_answers
from kvmesh.common.runtime.kv_event_stream import ensure_kv_events_stream
from kvmesh.common.runtime.metrics import MetricsEndpoint
from kvmesh.common.runtime.service import ServiceStack, service_main
from kvmesh.common.wire.hashing import block_set_digest, sequence_hashes
from kvmesh.common.wire.kv_events import DEVICE_TIER
from kvmesh.common.wire.worker_key import TierKey
from kvmesh.indexer import purge
from kvmesh.indexer import snapshot as snapshots
from kvmesh.indexer.config import IndexerConfig
from kvmesh.indexer.consumer import EventStreamConsumer
from kvmesh.indexer.metrics import IndexerState, build_registry
from kvmesh.indexer.recovery import GapRecovery
from kvmesh.indexer.snapshot_lock import SnapshotLock

log = structlog.get_logger(__name__)

MAX_QUERY_BLOCKS = 1 << 20
# how long a restored replica holds the snapshot lock for its new durable to be listed (purge.wait_listed)
DURABLE_LISTED_TIMEOUT_S = 10.0


class QueryRefused(ValueError):
    """A query this replica will not answer (too long)."""


class IndexerServicer(indexer_pb2_grpc.IndexerServicer):
    def __init__(
        self,
        replica_id: str,
        index: PrefixIndex,
        consumer: EventStreamConsumer,
        state: IndexerState,
        query_latency: Histogram,
        workers: DiscoveryWatcher | None = None,
    ) -> None:
        """``workers``: the discovered workers, whose records name the KV pool each can read."""
        self.workers = workers
        self.replica_id = replica_id
        self.index = index
        self.consumer = consumer
        self.state = state
        self.query_latency = query_latency

    async def FindMatches(
        self, request: indexer_pb2.FindMatchesRequest, context: grpc.aio.ServicerContext
    ) -> indexer_pb2.FindMatchesResponse:
        try:
            return self.find_matches(request)
        except QueryRefused as refused:
            await refuse(context, "indexer", grpc.StatusCode.INVALID_ARGUMENT, str(refused))
            raise  # refuse() aborts the call; this is never reached

    async def FindMatchesMany(
        self, request_iterator: AsyncIterator[indexer_pb2.FindMatchesQueries], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[indexer_pb2.FindMatchesAnswers]:
        """Answers each message's queries in one reply; a refused query is answered ``refused``,
        never by ending the stream (the caller's other queries ride on it)."""
        async for message in request_iterator:
            # built in place: a nested message given to a constructor is copied (docs/decisions/0019)
            reply = indexer_pb2.FindMatchesAnswers()
            for query in message.queries:
                answer = reply.answers.add(query_id=query.query_id)
                try:
                    self.find_matches(query.request, into=answer.response)
                except QueryRefused as refused:
                    answer.refused = str(refused)
            yield reply

    def find_matches(
        self, request: indexer_pb2.FindMatchesRequest, into: indexer_pb2.FindMatchesResponse | None = None
    ) -> indexer_pb2.FindMatchesResponse:
        """Per known worker: matched prefix blocks, tree size, MoE alignment and pooled blocks,
        written into ``into`` (an empty response, filled in place) or a new response. Raises
        :class:`QueryRefused` for a query longer than :data:`MAX_QUERY_BLOCKS`, before writing."""
        if max(len(request.local_hashes), len(request.sequence_hashes)) > MAX_QUERY_BLOCKS:
            raise QueryRefused(f"query longer than {MAX_QUERY_BLOCKS} blocks")
        started = time.perf_counter()
        sequence = request.sequence_hashes or sequence_hashes(request.local_hashes)
        experts = {(e.layer, e.expert) for e in request.moe_query}  # a dense model's query pays nothing for MoE
        answer = answer_query(self.index, sequence, experts, self._pool_of)
        self.query_latency.observe(time.perf_counter() - started)
        response = indexer_pb2.FindMatchesResponse() if into is None else into
        add = response.workers.add
        for key, size in answer.tree_sizes.items():
            aligned, hosted = answer.moe.get(key, (0, 0))
            add(
                worker_id=key[0],
                dp_rank=key[1],
                matched_blocks=answer.matched.get(key, 0),
                total_blocks=size,
                moe_aligned_blocks=aligned,
                moe_hosted_experts=hosted,
                pooled_blocks=answer.pooled.get(key, 0),
                host_blocks=answer.host.get(key, 0),
                disk_blocks=answer.disk.get(key, 0),
            )
        response.applied_sequence = self.consumer.applied_sequence
        return response

    def _pool_of(self) -> dict[int, str]:
        """The KV pool each discovered worker reads (most read none)."""
        if self.workers is None:
            return {}
        return {r.instance_id: r.extra["kv_pool"] for r in self.workers.instances() if r.extra.get("kv_pool")}

    async def GetStatus(
        self, request: indexer_pb2.IndexerStatusRequest, context: grpc.aio.ServicerContext
    ) -> indexer_pb2.IndexerStatus:
        recovering = set(self.index.recovering)
        stats = self.index.stats
        workers = []
        for key, size in self.index.tree_sizes().items():
            in_transit, evicted = self.index.tier_counts(key)
            workers.append(
                indexer_pb2.IndexedWorker(
                    worker_id=key[0],
                    dp_rank=key[1],
                    blocks=size,
                    last_event_id=self.index.last_event_id(key),
                    recovering=key in recovering,
                    blocks_digest=block_set_digest(self.index.worker_blocks(key)) if request.include_digests else 0,
                    tier=key.tier if isinstance(key, TierKey) else DEVICE_TIER,
                    in_transit_blocks=in_transit,
                    evicted_blocks=evicted,
                )
            )
        return indexer_pb2.IndexerStatus(
            replica_id=self.replica_id,
            applied_sequence=self.consumer.applied_sequence,
            stream_last_sequence=self.state.stream_last_sequence,
            lag_messages=self.state.lag_messages,
            workers=workers,
            events_applied=stats.events_applied,
            gaps=stats.gaps,
            recoveries=stats.recoveries,
            snapshot_sequence=self.state.snapshot_sequence,
            snapshots_taken=self.state.snapshots_taken,
        )


async def reconcile_forever(index: PrefixIndex, workers: DiscoveryWatcher, grace_s: float) -> None:
    """Drop workers the index knows but discovery has not listed for ``grace_s`` (for instance the
    events of long-gone workers replayed from the stream)."""
    absent_since: dict[int, float] = {}
    while True:
        await asyncio.sleep(grace_s / 4)
        now = time.monotonic()
        live = {r.instance_id for r in workers.instances()}
        for worker_id in {key[0] for key in index.workers()}:
            if worker_id in live:
                absent_since.pop(worker_id, None)
            elif now - absent_since.setdefault(worker_id, now) >= grace_s:
                index.remove_worker(worker_id)
                absent_since.pop(worker_id, None)
                log.info("dropped a worker absent from discovery", worker_id=worker_id)


async def serve(config: IndexerConfig, stop: asyncio.Event) -> None:
    instance_id = new_instance_id()
    async with ServiceStack() as stack:
        nc = await stack.nats(config, f"kvmesh-indexer-{config.replica_id}")
        js = nc.jetstream()
        await ensure_kv_events_stream(js, config.kv_events_max_age)
        index = PrefixIndex()
        state = IndexerState()
        registry, query_latency = build_registry(index, state)
        jetstream = JetStreamCollector()
        registry.register(jetstream)

        def worker_left(record: InstanceRecord) -> None:
            index.remove_worker(record.instance_id)
            log.info("dropped the blocks of a departed worker", worker_id=record.instance_id)

        recovery: GapRecovery | None = None

        def worker_joined(record: InstanceRecord) -> None:
            if index.is_removed(record.instance_id):
                # dropped while it lived on (its lease lapsed behind a partition): rebuild from its dump
                index.readmit_worker(record.instance_id)
                if recovery is not None:
                    recovery.poke()
                log.info("a dropped worker is back; recovering its blocks from its dump", worker_id=record.instance_id)

        workers = await stack.start(
            DiscoveryWatcher(js, config.namespace, "worker", on_added=worker_joined, on_removed=worker_left)
        )
        recovery = GapRecovery(index, workers)
        stack.push_async_callback(recovery.stop)
        # Restored under the snapshot lock, released once the durable is listed: a replica that took a
        # snapshot and purged between this one's read of the snapshot and its durable (which pins the
        # purge floor at the snapshot it read) would drop events this one never sees (a CI run did).
        restore_lock = SnapshotLock(js, config.namespace, f"{config.replica_id}:{instance_id}:restore")
        await restore_lock.wait_and_acquire()  # waits for JetStream to answer, as every acquire does
        stack.push_async_callback(restore_lock.release)  # also when the start fails
        start_after = await restore_snapshot(js, config, index, state)
        for record in workers.instances():  # the snapshot may list as removed a worker that is back
            worker_joined(record)
        recovery.poke()

        def applied(sequence: int) -> None:
            state.applied_sequence = sequence
            state.malformed_messages = consumer.malformed_messages
            if index.gaps_pending:
                recovery.poke()

        def lost() -> None:
            suspects = {key[0] for key in index.workers()} | {record.instance_id for record in workers.instances()}
            for worker_id in suspects:
                index.suspect_worker(worker_id)
            recovery.poke()
            log.warning("rebuilding every worker from its own dump", workers=len(suspects))

        consumer = EventStreamConsumer(
            nc,
            config.namespace,
            config.replica_id,
            index,
            on_applied=applied,
            inactive_threshold_s=config.durable_inactive_threshold,
            on_lost=lost,
        )
        await when_jetstream_answers(
            lambda: consumer.start(reset=config.router_reset_states, start_after=start_after), "event consumer"
        )
        stack.push_async_callback(consumer.stop)
        if not await purge.wait_listed(nc, config.namespace, consumer.durable, DURABLE_LISTED_TIMEOUT_S):
            # events purged meanwhile show as a gap at that worker's next event, and its dump rebuilds it
            log.warning("the durable is not listed yet; releasing the snapshot lock", durable=consumer.durable)
        await restore_lock.release()
        snapshotter = snapshots.Snapshotter(
            nc,
            config.namespace,
            f"{config.replica_id}:{instance_id}",
            index,
            lambda: consumer.applied_sequence,
            state,
            config.router_snapshot_threshold,
            config.snapshot_check_interval,
            durable=consumer.durable,
        )
        stack.task(snapshotter.run_forever(), "snapshotter")
        stack.task(jetstream.poll_forever(js), "jetstream-states")
        stack.task(reconcile_forever(index, workers, grace_s=2 * config.lease_ttl), "reconcile")
        metrics = MetricsEndpoint(config, registry)
        stack.push_async_callback(metrics.close)
        extra: dict[str, object] = {"replica_id": config.replica_id, **metrics.discovery_extra()}
        servicer = IndexerServicer(config.replica_id, index, consumer, state, query_latency, workers)
        registration = await stack.grpc_service(
            js,
            config,
            component="indexer",
            instance_id=instance_id,
            service_name=indexer_pb2.DESCRIPTOR.services_by_name["Indexer"].full_name,
            add_servicer=lambda server: indexer_pb2_grpc.add_IndexerServicer_to_server(servicer, server),
            extra=extra,
        )
        record = registration.record
        log.info("indexer ready", address=record.address, replica_id=config.replica_id, metrics=extra.get("metrics"))
        freeze_startup_heap()
        await stop.wait()


async def restore_snapshot(js: JetStreamContext, config: IndexerConfig, index: PrefixIndex, state: IndexerState) -> int:
    """Load the namespace's snapshot into ``index`` (unless ``--router-reset-states``); returns the
    stream sequence it covers (0: none, replay the stream from its start)."""
    if config.router_reset_states:
        return 0
    try:
        restored = await when_jetstream_answers(lambda: snapshots.load(js, config.namespace), "snapshot")
    except snapshots.SnapshotError as exc:
        log.error("ignoring an unreadable snapshot", error=str(exc))
        return 0
    if restored is None:
        return 0
    started = time.perf_counter()
    snapshots.restore(index, restored)
    state.snapshot_sequence = restored.stream_sequence
    log.info(
        "restored snapshot",
        stream_sequence=restored.stream_sequence,
        blocks=restored.num_blocks,
        seconds=round(time.perf_counter() - started, 3),
    )
    return restored.stream_sequence


def main(argv: Sequence[str] | None = None) -> None:
    service_main(
        IndexerConfig,
        argv,
        service="indexer",
        description="Run an indexer replica: consumes KV events from JetStream, answers overlap queries.",
        serve=serve,
    )
