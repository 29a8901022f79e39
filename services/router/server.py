"""The router service: picks a worker per request and streams that worker's answer back."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc
import structlog

from services.common.discovery import DiscoveryWatcher, InstanceRecord, new_instance_id
from services.common.grpc_server import insecure_channel
from services.common.hashing import local_block_hashes, sequence_hashes
from services.common.proto.kvmesh.v1 import (
    common_pb2,
    indexer_pb2,
    indexer_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2_grpc,
)
from services.common.runtime import connect_nats
from services.common.service import registered_grpc_service, service_main
from services.router.approximate_index import ApproximateIndex
from services.router.config import RouterConfig
from services.router.policy import RoutingPolicy
from services.router.scheduler import make_cost_model

log = structlog.get_logger(__name__)

WorkerKey = tuple[int, int]
# Assumed when a worker does not advertise its step token budget.
DEFAULT_MAX_BATCHED_TOKENS = 8192


class RoutingError(Exception):
    """A request cannot be routed; carries the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ChannelPool:
    """One gRPC channel per address, reused across requests."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = insecure_channel(address)
        return channel

    async def drop(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)


class Router:
    """Routing decisions plus the load picture they rely on. One per router process."""

    def __init__(
        self,
        config: RouterConfig,
        workers: DiscoveryWatcher,
        indexers: DiscoveryWatcher | None,
        channels: ChannelPool,
    ) -> None:
        self.config = config
        self.workers = workers
        self.indexers = indexers
        self.channels = channels
        self._rng = random.Random(config.seed)
        self._policies: dict[int, RoutingPolicy] = {}
        self._approximate: dict[int, ApproximateIndex] = {}

    def approximate_index(self, block_size: int) -> ApproximateIndex:
        """Approximate mode's view of the caches of workers with this block size."""
        index = self._approximate.get(block_size)
        if index is None:
            index = self._approximate[block_size] = ApproximateIndex(
                block_size, self.config.router_ttl_secs, self.config.router_max_tree_size
            )
        return index

    def policy(self, worker: InstanceRecord) -> RoutingPolicy:
        """The policy (and load picture) of workers shaped like ``worker`` (same block size).

        The cost model takes the engine shape (capacity, step token budget) from the first worker of
        that block size it meets: a fleet serving one model is assumed homogeneous.
        """
        policy = self._policies.get(worker.block_size)
        if policy is None:
            mode = "kv" if self.config.router_mode == "direct" else self.config.router_mode
            cost_model = make_cost_model(
                self.config.kv_cost,
                worker.block_size,
                int(worker.extra.get("max_num_batched_tokens", DEFAULT_MAX_BATCHED_TOKENS)),
                worker.capacity_blocks,
            )
            policy = self._policies[worker.block_size] = RoutingPolicy(
                mode,
                worker.block_size,
                self.config.kv_overlap_score_weight,
                self.config.router_temperature,
                self._rng,
                cost_model,
            )
        return policy

    def worker_left(self, record: InstanceRecord) -> None:
        for policy in self._policies.values():
            policy.active.remove_worker(record.instance_id)
        for index in self._approximate.values():
            index.remove_worker(record.instance_id)

    def candidates(self, model: str) -> list[InstanceRecord]:
        return [r for r in self.workers.instances() if not model or r.model == model]

    async def overlaps(self, block_hashes: list[int]) -> tuple[dict[WorkerKey, int], dict[WorkerKey, int]]:
        """(matched blocks, tree size) per worker from an indexer replica; empty if none answers."""
        replicas = self.indexers.instances() if self.indexers else []
        self._rng.shuffle(replicas)
        timeout = self.config.indexer_timeout_ms / 1000.0
        for replica in replicas:
            stub = indexer_pb2_grpc.IndexerStub(self.channels.get(replica.address))
            try:
                response = await stub.FindMatches(
                    indexer_pb2.FindMatchesRequest(sequence_hashes=block_hashes), timeout=timeout
                )
            except grpc.aio.AioRpcError as exc:
                log.warning("indexer replica did not answer", address=replica.address, code=exc.code().name)
                continue
            matched = {(w.worker_id, w.dp_rank): w.matched_blocks for w in response.workers}
            sizes = {(w.worker_id, w.dp_rank): w.total_blocks for w in response.workers}
            return matched, sizes
        log.warning("no indexer answered; routing on load alone")
        return {}, {}

    async def choose(self, request: common_pb2.PreprocessedRequest) -> tuple[InstanceRecord, int, list[int]]:
        """Pick the worker; returns (worker record, overlap blocks, full-block sequence hashes)."""
        candidates = self.candidates(request.model)
        if not candidates:
            raise RoutingError(grpc.StatusCode.UNAVAILABLE, f"no worker available for model {request.model!r}")
        by_id = {r.instance_id: r for r in candidates}
        block_size = candidates[0].block_size
        lora = request.lora_name if request.HasField("lora_name") else None
        local_hashes = local_block_hashes(request.token_ids, block_size, lora)
        block_hashes = sequence_hashes(local_hashes)

        forced = request.routing.worker_id if request.routing.HasField("worker_id") else None
        if forced is not None or self.config.router_mode == "direct":
            if forced is None:
                raise RoutingError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "router mode 'direct' needs routing.worker_id in the request",
                )
            record = by_id.get(forced)
            if record is None:
                raise RoutingError(grpc.StatusCode.NOT_FOUND, f"worker {forced} is not registered for this model")
            return record, 0, block_hashes

        policy = self.policy(candidates[0])
        matched: dict[WorkerKey, int] = {}
        sizes: dict[WorkerKey, int] = {}
        approximate = None if self.config.kv_events else self.approximate_index(block_size)
        if policy.needs_overlaps:
            if approximate is None:
                matched, sizes = await self.overlaps(block_hashes)
            else:
                matched = approximate.find_matches_by_sequence(block_hashes, time.monotonic())
                sizes = dict(approximate.tree_sizes())
        override = request.routing.router_config_override
        decision = policy.choose(
            [(r.instance_id, 0) for r in candidates],
            block_hashes,
            len(request.token_ids),
            matched,
            sizes,
            override.overlap_score_weight if override.HasField("overlap_score_weight") else None,
            override.router_temperature if override.HasField("router_temperature") else None,
        )
        if approximate is not None:
            approximate.record(decision.worker, local_hashes, block_hashes, time.monotonic())
        return by_id[decision.worker[0]], decision.overlap_blocks, block_hashes


class RouterServicer(router_pb2_grpc.RouterServicer):
    """``Generate``: route, track the load (add, prefill completed, free) and relay the stream."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(
        self, request: common_pb2.PreprocessedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateOutput]:
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        request_id = request.request_id
        structlog.contextvars.bind_contextvars(request_id=request_id)
        if not request.token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        try:
            record, overlap, block_hashes = await self.router.choose(request)
        except RoutingError as exc:
            await context.abort(exc.code, str(exc))
        active = self.router.policy(record).active
        worker_key = (record.instance_id, 0)
        active.add(request_id, worker_key, block_hashes, len(request.token_ids), overlap)
        log.info(
            "routed",
            worker_id=record.instance_id,
            overlap_blocks=overlap,
            mode=self.router.config.router_mode,
        )
        stub = worker_pb2_grpc.WorkerStub(self.router.channels.get(record.address))
        first = True
        try:
            async for output in stub.Generate(request):
                if first:
                    active.mark_prefill_completed(request_id)
                    first = False
                yield output
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
                code = grpc.StatusCode.UNAVAILABLE
                message = f"worker {record.instance_id} failed: {exc.details()}"
            else:
                message = exc.details() or code.name
            log.warning("worker stream failed", worker_id=record.instance_id, code=exc.code().name)
            await context.abort(code, message)
        finally:
            active.free(request_id)
            structlog.contextvars.unbind_contextvars("request_id")


async def serve(config: RouterConfig, stop: asyncio.Event) -> None:
    instance_id = new_instance_id()
    nc = await connect_nats(config.nats_url, name=f"kvmesh-router-{instance_id}")
    js = nc.jetstream()
    channels = ChannelPool()
    router_ref: list[Router] = []

    async def worker_left(record: InstanceRecord) -> None:
        if router_ref:
            router_ref[0].worker_left(record)
        await channels.drop(record.address)

    workers = DiscoveryWatcher(js, config.namespace, "worker", on_removed=worker_left)
    indexers = DiscoveryWatcher(js, config.namespace, "indexer")
    await workers.start()
    await indexers.start()
    router = Router(config, workers, indexers, channels)
    router_ref.append(router)
    servicer = RouterServicer(router)
    try:
        async with registered_grpc_service(
            js,
            config,
            component="router",
            instance_id=instance_id,
            service_name=router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
            add_servicer=lambda server: router_pb2_grpc.add_RouterServicer_to_server(servicer, server),
            extra={"mode": config.router_mode},
        ) as record:
            log.info("router ready", address=record.address, mode=config.router_mode)
            await stop.wait()
    finally:
        await workers.stop()
        await indexers.stop()
        await channels.close()
        await nc.close()


def main(argv: Sequence[str] | None = None) -> None:
    service_main(
        RouterConfig,
        argv,
        service="router",
        description="Run a router (kvmesh.v1.Router): sends each request to the cheapest worker.",
        serve=serve,
    )
