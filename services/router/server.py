"""The router service: picks a worker per request and streams that worker's answer back."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import structlog

from kvmesh.common.disagg import DECODE, KV_SOURCE, DisaggParams, DisaggParamsError, new_room
from kvmesh.common.discovery import DiscoveryWatcher, InstanceRecord, new_instance_id
from kvmesh.common.grpc_errors import is_transport_failure, refuse
from kvmesh.common.grpc_server import insecure_channel
from kvmesh.common.hashing import local_block_hashes, sequence_hashes
from kvmesh.common.metrics import MetricsEndpoint
from kvmesh.common.proto.kvmesh.v1 import (
    common_pb2,
    indexer_pb2,
    indexer_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2_grpc,
)
from kvmesh.common.requests import DEFAULT_MAX_TOKENS, continue_request
from kvmesh.common.runtime import cancel_and_wait, connect_nats
from kvmesh.common.service import registered_grpc_service, service_main
from kvmesh.router.approximate_index import ApproximateIndex
from kvmesh.router.config import RouterConfig
from kvmesh.router.disagg import (
    LocalPrefill,
    NoCapacity,
    PrefillJob,
    RemotePrefill,
    bootstrap_params,
    decode_request,
    place_prefill,
    prefill_request,
)
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.policy import RoutingPolicy
from kvmesh.router.replica_sync import ADD, FREE, PREFILL_DONE, ReplicaSync, SyncMessage
from kvmesh.router.scheduler import make_cost_model

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


@dataclass
class Prepared:
    """A request's candidates and hashes, computed once per routing decision."""

    candidates: list[InstanceRecord]
    by_id: dict[int, InstanceRecord]
    policy: RoutingPolicy
    local_hashes: list[int]
    block_hashes: list[int]
    prompt_tokens: int
    expected_output_tokens: int


class Router:
    """Routing decisions plus the load picture they rely on. One per router process.

    Guarantees: every request it routes is added to the load picture, marked prefill-completed on
    its first token and freed when it ends, in this replica and (with replica sync) in every other.
    """

    def __init__(
        self,
        config: RouterConfig,
        workers: DiscoveryWatcher,
        indexers: DiscoveryWatcher | None,
        channels: ChannelPool,
        router_id: str = "",
    ) -> None:
        self.config = config
        self.workers = workers
        self.indexers = indexers
        self.channels = channels
        self.router_id = router_id
        self.sync: ReplicaSync | None = None
        self._rng = random.Random(config.seed)
        self._policies: dict[int, RoutingPolicy] = {}
        self._approximate: dict[int, ApproximateIndex] = {}
        self._avoid_until: dict[int, float] = {}
        # requests routed by other replicas: key -> block size, and each replica's keys
        self._remote: dict[str, int] = {}
        self._remote_by_router: dict[str, set[str]] = {}

    def policies(self) -> list[RoutingPolicy]:
        return list(self._policies.values())

    def avoid(self, worker_id: int) -> None:
        """Do not choose this worker for ``--worker-avoid-secs`` (its stream just broke)."""
        self._avoid_until[worker_id] = time.monotonic() + self.config.worker_avoid_secs

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
                self.config.track_active_blocks,
                self.config.router_track_output_blocks,
            )
        return policy

    def worker_left(self, record: InstanceRecord) -> None:
        for policy in self._policies.values():
            policy.active.remove_worker(record.instance_id)
        for index in self._approximate.values():
            index.remove_worker(record.instance_id)

    def candidates(self, model: str) -> list[InstanceRecord]:
        """Workers serving ``model`` whole requests, without those recently failed (unless no other
        is left). Prefill-role workers only ever prefill for another worker, so they are left out;
        decode-role workers can prefill locally and serve whole requests."""
        serving = [r for r in self.workers.instances() if (not model or r.model == model) and r.role != "prefill"]
        return self._not_avoided(serving) or serving

    def _not_avoided(self, records: list[InstanceRecord]) -> list[InstanceRecord]:
        now = time.monotonic()
        return [r for r in records if self._avoid_until.get(r.instance_id, 0.0) <= now]

    def not_busy(self, prepared: Prepared, noun: str = "workers") -> list[InstanceRecord]:
        """The prepared candidates under the busy thresholds; RESOURCE_EXHAUSTED when none is."""
        candidates = [r for r in prepared.candidates if not self.busy(prepared.policy, r.instance_id)]
        if not candidates:
            raise RoutingError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"all {len(prepared.candidates)} {noun} are busy (over their active block or prefill thresholds)",
            )
        return candidates

    def busy(self, policy: RoutingPolicy, worker_id: int) -> bool:
        """Over ``--active-decode-blocks-threshold`` or ``--active-prefill-tokens-threshold``."""
        prefill, decode = policy.active.load((worker_id, 0))
        blocks_limit = self.config.active_decode_blocks_threshold
        prefill_limit = self.config.active_prefill_tokens_threshold
        return (blocks_limit is not None and decode > blocks_limit) or (
            prefill_limit is not None and prefill > prefill_limit
        )

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

    def prepare(self, request: common_pb2.PreprocessedRequest) -> Prepared:
        candidates = self.candidates(request.model)
        if not candidates:
            raise RoutingError(grpc.StatusCode.UNAVAILABLE, f"no worker available for model {request.model!r}")
        block_size = candidates[0].block_size
        lora = request.lora_name if request.HasField("lora_name") else None
        local_hashes = local_block_hashes(request.token_ids, block_size, lora)
        expected = request.expected_output_tokens if request.HasField("expected_output_tokens") else 0
        return Prepared(
            candidates,
            {r.instance_id: r for r in candidates},
            self.policy(candidates[0]),
            local_hashes,
            sequence_hashes(local_hashes),
            len(request.token_ids),
            expected,
        )

    async def cache_view(self, prepared: Prepared) -> tuple[dict[WorkerKey, int], dict[WorkerKey, int]]:
        """(matched blocks, tree size) per worker: from the indexers, or approximate mode's memory."""
        if not prepared.policy.needs_overlaps:
            return {}, {}
        if self.config.kv_events:
            return await self.overlaps(prepared.block_hashes)
        approximate = self.approximate_index(prepared.policy.block_size)
        matched = approximate.find_matches_by_sequence(prepared.block_hashes, time.monotonic())
        return matched, dict(approximate.tree_sizes())

    async def choose(
        self, request: common_pb2.PreprocessedRequest, commit: bool = True
    ) -> tuple[InstanceRecord, int, list[int]]:
        """Pick the worker; returns (worker record, overlap blocks, full-block sequence hashes).

        ``commit=False`` answers a query (BestWorker) without leaving a trace in approximate mode.
        """
        prepared = self.prepare(request)
        forced = request.routing.worker_id if request.routing.HasField("worker_id") else None
        if forced is not None or self.config.router_mode == "direct":
            if forced is None:
                raise RoutingError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "router mode 'direct' needs routing.worker_id in the request",
                )
            record = prepared.by_id.get(forced)
            if record is None:
                raise RoutingError(grpc.StatusCode.NOT_FOUND, f"worker {forced} is not registered for this model")
            return record, 0, prepared.block_hashes

        candidates = self.not_busy(prepared)
        matched, sizes = await self.cache_view(prepared)
        weight, temperature = config_overrides(request)
        decision = prepared.policy.choose(
            [(r.instance_id, 0) for r in candidates],
            prepared.block_hashes,
            prepared.prompt_tokens,
            matched,
            sizes,
            weight,
            temperature,
            prepared.expected_output_tokens,
        )
        if commit and not self.config.kv_events:
            self.approximate_index(prepared.policy.block_size).record(
                decision.worker, prepared.local_hashes, prepared.block_hashes, time.monotonic()
            )
        return prepared.by_id[decision.worker[0]], decision.overlap_blocks, prepared.block_hashes

    def prefill_pool(self, model: str) -> list[InstanceRecord]:
        """Prefill-role workers serving ``model``, without those recently failed."""
        pool = [r for r in self.workers.instances() if r.role == "prefill" and (not model or r.model == model)]
        return self._not_avoided(pool)

    async def plan_prefill(self, request: common_pb2.PreprocessedRequest) -> RemotePrefill | LocalPrefill | None:
        """Where this request prefills while prefill workers exist (see services/router/disagg.py);
        None when no prefill worker is registered (or none shares the decode workers' block size):
        the request is routed as an aggregated one."""
        enforce = self.config.enforce_disagg
        pool = self.prefill_pool(request.model)
        if pool:
            prepared = self.prepare(request)
            pool = [r for r in pool if r.block_size == prepared.policy.block_size]
        if not pool:
            if enforce:
                raise RoutingError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no prefill worker is available for model {request.model!r} and --enforce-disagg is set",
                )
            return None
        candidates = self.not_busy(prepared, "decode workers")
        matched, sizes = await self.cache_view(prepared)
        weight, temperature = config_overrides(request)
        policy = prepared.policy
        try:
            placement = place_prefill(
                policy,
                [(r.instance_id, 0) for r in candidates],
                [(r.instance_id, 0) for r in pool],
                prepared.block_hashes,
                prepared.prompt_tokens,
                matched,
                sizes,
                min_uncached_tokens=self.config.disagg_min_uncached_tokens,
                prefill_queue_limit_tokens=self.config.prefill_queue_limit_tokens,
                enforce=enforce,
                overlap_score_weight=weight,
                temperature=temperature,
                expected_output_tokens=prepared.expected_output_tokens,
                busy=lambda key: self.busy(policy, key[0]),
            )
        except NoCapacity as exc:
            raise RoutingError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc} and --enforce-disagg is set") from None
        decode = prepared.by_id[placement.decode[0]]
        if placement.prefill is None:
            return LocalPrefill(decode, placement.overlap, prepared.block_hashes, placement.reason)
        prefill = next(r for r in pool if r.instance_id == placement.prefill[0])
        return RemotePrefill(prefill, placement.overlap, decode, prepared.block_hashes)

    async def potential_loads(self, request: common_pb2.PreprocessedRequest) -> list[router_pb2.WorkerLoad]:
        prepared = self.prepare(request)
        matched, _sizes = await self.cache_view(prepared)
        workers = [(r.instance_id, 0) for r in prepared.candidates]
        active = prepared.policy.active
        loads = []
        for load in active.potential_loads(
            workers, prepared.block_hashes, prepared.prompt_tokens, matched, prepared.expected_output_tokens
        ):
            now_prefill, now_decode = active.load(load.worker)
            loads.append(
                router_pb2.WorkerLoad(
                    worker_id=load.worker[0],
                    dp_rank=load.worker[1],
                    overlap_blocks=matched.get(load.worker, 0),
                    potential_prefill_tokens=load.prefill_tokens,
                    potential_decode_blocks=load.decode_blocks,
                    active_prefill_tokens=now_prefill,
                    active_decode_blocks=now_decode,
                )
            )
        return loads

    # ---- the load picture, shared with the other replicas ----------------------------------
    def track_add(
        self,
        request_id: str,
        record: InstanceRecord,
        block_hashes: list[int],
        prompt_tokens: int,
        overlap: int,
        expected_output_tokens: int,
    ) -> None:
        key = (record.instance_id, 0)
        self.policy(record).active.add(
            request_id, key, block_hashes, prompt_tokens, overlap, expected_output_tokens, time.monotonic()
        )
        if self.sync is not None:
            self.sync.added(
                request_id, key, record.block_size, block_hashes, prompt_tokens, overlap, expected_output_tokens
            )

    def track_first_token(self, record: InstanceRecord, request_id: str) -> None:
        self.policy(record).active.mark_prefill_completed(request_id)
        if self.sync is not None:
            self.sync.prefill_completed(request_id)

    def track_output(self, record: InstanceRecord, request_id: str, tokens: int) -> None:
        self.policy(record).active.add_output(request_id, tokens)

    def track_free(self, record: InstanceRecord, request_id: str) -> None:
        self.policy(record).active.free(request_id)
        if self.sync is not None:
            self.sync.freed(request_id)

    def apply_remote(self, message: SyncMessage) -> None:
        """Another replica's request event, applied under a key that cannot clash with ours."""
        key = f"{message.router_id}/{message.request_id}"
        if message.kind == ADD:
            record = self.workers.get(message.worker_id)
            if record is None:
                return  # a worker this replica does not know (yet): nothing to predict for
            self.policy(record).active.add(
                key,
                (message.worker_id, message.dp_rank),
                message.block_hashes,
                message.prompt_tokens,
                message.overlap_blocks,
                message.expected_output_tokens,
                time.monotonic(),
            )
            self._remote[key] = record.block_size
            self._remote_by_router.setdefault(message.router_id, set()).add(key)
            return
        block_size = self._remote.get(key)
        if block_size is None:
            return
        policy = self._policies[block_size]
        if message.kind == PREFILL_DONE:
            policy.active.mark_prefill_completed(key)
        elif message.kind == FREE:
            policy.active.free(key)
            del self._remote[key]
            self._remote_by_router.get(message.router_id, set()).discard(key)

    def forget_router(self, router_id: str) -> None:
        """A replica went silent: drop every request it had told us about."""
        for key in self._remote_by_router.pop(router_id, set()):
            block_size = self._remote.pop(key, None)
            if block_size is not None:
                self._policies[block_size].active.free(key)

    def expire_stale(self) -> None:
        now = time.monotonic()
        for policy in self._policies.values():
            for key in policy.active.expire(now, self.config.request_timeout_secs):
                block_size = self._remote.pop(key, None)
                if block_size is not None:
                    router_id = key.split("/", 1)[0]
                    self._remote_by_router.get(router_id, set()).discard(key)
                log.warning("forgot a request routed too long ago", request_id=key)


class RouterServicer(router_pb2_grpc.RouterServicer):
    """``Generate``: route, track the load (add, prefill completed, free) and relay the stream.

    If the worker's stream breaks (the worker died, not refused), the request moves to another
    worker with the prompt plus the tokens generated so far and the remaining budget, up to
    ``--migration-limit`` times; the client sees one uninterrupted stream.
    """

    def __init__(self, router: Router, metrics: RouterMetrics | None = None) -> None:
        self.router = router
        self.metrics = metrics or RouterMetrics(router.policies, lambda: 0)

    async def Generate(
        self, request: common_pb2.PreprocessedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GenerateOutput]:
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        request_id = request.request_id
        structlog.contextvars.bind_contextvars(request_id=request_id)
        if not request.token_ids:
            await refuse(context, "router", grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        if request.disaggregated_params:
            await refuse(
                context,
                "router",
                grpc.StatusCode.INVALID_ARGUMENT,
                "disaggregated_params is set by the router itself; send the request without it",
            )
        max_tokens = request.stop.max_tokens or DEFAULT_MAX_TOKENS
        prompt_tokens = len(request.token_ids)
        forced = request.routing.HasField("worker_id") or self.router.config.router_mode == "direct"
        generated: list[int] = []
        cached_tokens: int | None = None
        migrations = 0
        try:
            while True:
                attempt = (
                    request if migrations == 0 else continue_request(request, generated, max_tokens, f"m{migrations}")
                )
                prefill: PrefillJob | None = None
                try:
                    with self.metrics.decision_seconds.time():
                        plan = None if forced or migrations else await self.router.plan_prefill(attempt)
                        if plan is None:
                            record, overlap, block_hashes = await self.router.choose(attempt)
                        elif isinstance(plan, LocalPrefill):
                            record, overlap, block_hashes = plan.decode, plan.overlap, plan.block_hashes
                            self.metrics.prefills.labels("local", plan.reason).inc()
                        else:
                            record, block_hashes = plan.decode, plan.block_hashes
                            overlap = len(block_hashes)  # its KV arrives: only the tail is computed there
                    if isinstance(plan, RemotePrefill):
                        attempt, prefill = await self._start_prefill(attempt, plan)
                        if prefill is None:  # sync path, prefill failed: this worker prefills itself
                            overlap = 0
                except RoutingError as exc:
                    self.metrics.requests.labels(exc.code.name.lower()).inc()
                    await refuse(context, "router", exc.code, str(exc))
                expected = attempt.expected_output_tokens if attempt.HasField("expected_output_tokens") else 0
                self.router.track_add(
                    attempt.request_id, record, block_hashes, len(attempt.token_ids), overlap, expected
                )
                log.info(
                    "routed",
                    worker_id=record.instance_id,
                    overlap_blocks=overlap,
                    mode=self.router.config.router_mode,
                    migration=migrations,
                    prefill_worker_id=plan.prefill.instance_id if isinstance(plan, RemotePrefill) else None,
                )
                stub = worker_pb2_grpc.WorkerStub(self.router.channels.get(record.address))
                try:
                    first = True
                    async for output in stub.Generate(attempt):
                        if first:
                            self.router.track_first_token(record, attempt.request_id)
                            first = False
                            if prefill is not None:
                                remote_cached = await self._account_kv_source(output, prefill)
                                if remote_cached is not None:
                                    cached_tokens = remote_cached
                        output.ClearField("disaggregated_params")
                        self.router.track_output(record, attempt.request_id, len(output.token_ids))
                        generated.extend(output.token_ids)
                        if cached_tokens is None:
                            cached_tokens = output.usage.cached_prompt_tokens
                        # usage as the client asked: the original prompt, every token of every attempt
                        output.usage.prompt_tokens = prompt_tokens
                        output.usage.completion_tokens = len(generated)
                        output.usage.cached_prompt_tokens = cached_tokens
                        yield output
                    self.metrics.requests.labels("completed").inc()
                    return
                except grpc.aio.AioRpcError as exc:
                    if not is_transport_failure(exc):
                        await refuse(context, "router", exc.code(), exc.details() or exc.code().name)
                    self.router.avoid(record.instance_id)
                    log.warning(
                        "worker stream broke",
                        worker_id=record.instance_id,
                        code=exc.code().name,
                        tokens_so_far=len(generated),
                    )
                    if forced or migrations >= self.router.config.migration_limit:
                        await refuse(
                            context,
                            "router",
                            grpc.StatusCode.UNAVAILABLE,
                            f"worker {record.instance_id} failed after {len(generated)} tokens "
                            f"({'forced worker' if forced else f'{migrations} migrations'})",
                        )
                    if len(generated) >= max_tokens:  # it died after the last token: finish for it
                        yield finished_output(prompt_tokens, len(generated), cached_tokens or 0, record.instance_id)
                        self.metrics.requests.labels("completed").inc()
                        return
                    migrations += 1
                    self.metrics.migrations.inc()
                finally:
                    self.router.track_free(record, attempt.request_id)
                    if prefill is not None:
                        await prefill.close()
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def _start_prefill(
        self, request: common_pb2.PreprocessedRequest, plan: RemotePrefill
    ) -> tuple[common_pb2.PreprocessedRequest, PrefillJob | None]:
        """Send the prefill half to the prefill worker; return the decode half to send and the job.

        Bootstrap: the decode half carries the rendezvous at once. Sync: wait for the prefill's
        answer and inject it; if the prefill failed, the request goes to the decode worker whole
        (no job), or fails under --enforce-disagg."""
        config = self.router.config
        room = new_room()
        prefill_half = prefill_request(request, room)
        record = plan.prefill
        self.router.track_add(
            prefill_half.request_id, record, plan.block_hashes, len(request.token_ids), plan.prefill_overlap, 0
        )

        def prefill_done() -> None:
            self.router.track_free(record, prefill_half.request_id)

        stub = worker_pb2_grpc.WorkerStub(self.router.channels.get(record.address))
        job = PrefillJob(record.instance_id, stub, prefill_half, prefill_done)
        if config.disagg_mode == "bootstrap":
            return decode_request(request, bootstrap_params(record, room, not config.enforce_disagg)), job
        result = await job.result()
        if result is None:
            if job.transport_failed:
                self.router.avoid(record.instance_id)
            if config.enforce_disagg:
                raise RoutingError(
                    grpc.StatusCode.UNAVAILABLE, f"prefill on worker {record.instance_id} failed: {job.error}"
                )
            self.metrics.prefills.labels("local", "prefill_failed").inc()
            return request, None
        params = result.params
        params.kind, params.allow_local = DECODE, not config.enforce_disagg
        return decode_request(request, params), job

    async def _account_kv_source(self, output: common_pb2.GenerateOutput, prefill: PrefillJob) -> int | None:
        """Count where the decode worker got the prompt's KV; returns the prefill worker's cached
        prompt tokens when the KV came from it (the usage the client sees), else None."""
        try:
            source = DisaggParams.decode(output.disaggregated_params)
        except DisaggParamsError:
            source = DisaggParams(KV_SOURCE, source="local", reason="transfer_failed")
        if source.source == "remote":
            self.metrics.prefills.labels("remote", "").inc()
            self.metrics.kv_transfer_bytes.labels(source.backend).inc(source.bytes)
            # the prefill answered before the decode worker could pull: this does not wait in practice
            result = await prefill.result(timeout=1.0)
            return result.cached_tokens if result is not None else None
        reason = source.reason
        if prefill.task.done() and prefill.task.result() is None:
            reason = "prefill_failed"
            if prefill.transport_failed:
                self.router.avoid(prefill.worker_id)
        self.metrics.prefills.labels("local", reason).inc()
        return None

    async def BestWorker(
        self, request: router_pb2.RoutingQuery, context: grpc.aio.ServicerContext
    ) -> router_pb2.BestWorkerResponse:
        if not request.token_ids:
            await refuse(context, "router", grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        try:
            record, overlap, _hashes = await self.router.choose(as_request(request), commit=False)
        except RoutingError as exc:
            await refuse(context, "router", exc.code, str(exc))
        return router_pb2.BestWorkerResponse(worker_id=record.instance_id, dp_rank=0, overlap_blocks=overlap)

    async def PotentialLoads(
        self, request: router_pb2.RoutingQuery, context: grpc.aio.ServicerContext
    ) -> router_pb2.PotentialLoadsResponse:
        if not request.token_ids:
            await refuse(context, "router", grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        try:
            loads = await self.router.potential_loads(as_request(request))
        except RoutingError as exc:
            await refuse(context, "router", exc.code, str(exc))
        return router_pb2.PotentialLoadsResponse(loads=loads)


def config_overrides(request: common_pb2.PreprocessedRequest) -> tuple[float | None, float | None]:
    """The request's (overlap score weight, router temperature) overrides; None where unset."""
    override = request.routing.router_config_override
    return (
        override.overlap_score_weight if override.HasField("overlap_score_weight") else None,
        override.router_temperature if override.HasField("router_temperature") else None,
    )


def as_request(query: router_pb2.RoutingQuery) -> common_pb2.PreprocessedRequest:
    """A routing query in the shape of the request it asks about."""
    request = common_pb2.PreprocessedRequest(model=query.model, token_ids=query.token_ids)
    if query.HasField("lora_name"):
        request.lora_name = query.lora_name
    if query.HasField("expected_output_tokens"):
        request.expected_output_tokens = query.expected_output_tokens
    request.routing.router_config_override.CopyFrom(query.router_config_override)
    return request


def finished_output(prompt_tokens: int, completion: int, cached: int, worker_id: int) -> common_pb2.GenerateOutput:
    return common_pb2.GenerateOutput(
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        worker_id=worker_id,
        usage=common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, cached_prompt_tokens=cached),
    )


async def expire_forever(router: Router) -> None:
    while True:
        await asyncio.sleep(min(10.0, router.config.request_timeout_secs / 4))
        router.expire_stale()


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
    router = Router(config, workers, indexers, channels, router_id=str(instance_id))
    router_ref.append(router)
    if config.router_replica_sync:
        router.sync = ReplicaSync(nc, config.namespace, router.router_id, router.apply_remote, router.forget_router)
        await router.sync.start()
    expiry = asyncio.create_task(expire_forever(router), name="expire-requests")
    metrics = RouterMetrics(router.policies, lambda: len(router.sync.peers()) if router.sync else 0)
    endpoint = MetricsEndpoint(config, metrics.registry)
    servicer = RouterServicer(router, metrics)
    try:
        async with registered_grpc_service(
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
        ) as record:
            log.info("router ready", address=record.address, mode=config.router_mode)
            await stop.wait()
    finally:
        await cancel_and_wait(expiry)
        await endpoint.close()
        if router.sync is not None:
            await router.sync.stop()
        await workers.stop()
        await indexers.stop()
        await channels.close()
        await nc.close()


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
