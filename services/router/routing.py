"""The routing decision of one router replica, and the load picture it keeps while requests run.

:class:`Router` picks a worker (or a prefill + decode pair) for a request: it filters the discovered
workers (:mod:`~kvmesh.router.eligibility`), asks the indexers or its approximate index what each
caches, and lets the per-block-size :class:`RoutingPolicy` cost them. What it routes it tracks in a
:class:`LoadTracker`, and with replica sync it tells the other replicas. Time comes from the clock it
is given.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import grpc
import structlog

from kvmesh.common.core.tier_credits import credited_matches
from kvmesh.common.core.timing import from_constants
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2
from kvmesh.common.rpc.grpc_errors import NO_WORKER
from kvmesh.common.rpc.status_error import StatusError
from kvmesh.common.runtime.discovery import DiscoveryWatcher, InstanceRecord
from kvmesh.common.runtime.misconfiguration import Findings
from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes, token_bytes
from kvmesh.common.wire.lora import must_load
from kvmesh.common.wire.worker_key import WorkerKey, ranks_of
from kvmesh.router.approximate_index import ApproximateIndex
from kvmesh.router.config import RouterConfig
from kvmesh.router.eligibility import (
    BusyThresholds,
    FailedWorkers,
    not_busy,
    prefill_workers,
    whole_request_workers,
)
from kvmesh.router.fleet_checks import FleetChecks
from kvmesh.router.indexer_client import CacheView, IndexerClient
from kvmesh.router.load_tracker import LoadTracker
from kvmesh.router.policy import RoutingPolicy
from kvmesh.router.predicted_blocks import PredictedBlocks
from kvmesh.router.prefill_job import LocalPrefill, RemotePrefill
from kvmesh.router.prefill_placement import NoCapacity, place_prefill
from kvmesh.router.replica_sync import ReplicaSync
from kvmesh.router.request_queue import AllWorkersBusy
from kvmesh.router.scheduler import PerWorkerTtftCost, make_cost_model
from kvmesh.router.split_overhead import SplitOverhead
from kvmesh.router.sync_messages import ADD, SyncMessage

log = structlog.get_logger(__name__)

# Assumed when a worker does not advertise its step token budget.
DEFAULT_MAX_BATCHED_TOKENS = 8192


class RoutingError(StatusError):
    """A request cannot be routed; carries the gRPC status to answer with."""


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
    token_ids: Sequence[int] = ()
    moe_query: Sequence[common_pb2.MoeExpert] = ()

    @cached_property
    def tokens(self) -> bytes:
        """The prompt as cache-aware mode's tree holds it (built once, only when asked for)."""
        return token_bytes(self.token_ids)


@dataclass(frozen=True)
class Choice:
    """The worker chosen for a whole request, its cached prefix there and the prompt's block hashes;
    ``dp_rank``: its data-parallel rank chosen (None: the worker picks, for a request that named
    the worker but no rank)."""

    worker: InstanceRecord
    overlap_blocks: int
    block_hashes: list[int]
    dp_rank: int | None = 0

    @property
    def key(self) -> WorkerKey:
        return (self.worker.instance_id, self.dp_rank or 0)


def config_overrides(request: common_pb2.PreprocessedRequest) -> tuple[float | None, float | None]:
    """The request's (overlap score weight, router temperature) overrides; None where unset."""
    override = request.routing.router_config_override
    return (
        override.overlap_score_weight if override.HasField("overlap_score_weight") else None,
        override.router_temperature if override.HasField("router_temperature") else None,
    )


def moe_hosted_shares(
    moe: dict[tuple[int, int], tuple[int, int]], query: Sequence[common_pb2.MoeExpert]
) -> dict[tuple[int, int], float]:
    """Per worker, the share of the request's distinct MoE experts its cached blocks were computed with."""
    wanted = len({(e.layer, e.expert) for e in query})
    return {worker: min(1.0, hosted / wanted) for worker, (_aligned, hosted) in moe.items()} if wanted else {}


def uncached_tokens(prepared: Prepared, matched: dict[tuple[int, int], int]) -> int:
    """The prompt tokens the candidate with the longest cached prefix lacks."""
    best = max((matched.get((r.instance_id, 0), 0) for r in prepared.candidates), default=0)
    return max(0, prepared.prompt_tokens - best * prepared.policy.block_size)


class Router:
    """Routing decisions plus the load picture they rely on. One per router process.

    Guarantees: every request it routes is added to the load picture, marked prefill-completed on
    its first token and freed when it ends, in this replica and (with replica sync) in every other.
    """

    def __init__(
        self,
        config: RouterConfig,
        workers: DiscoveryWatcher,
        indexers: IndexerClient,
        router_id: str = "",
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        """``rng`` (tie-breaking, sampling) defaults to one seeded with ``--seed``; the service shares
        it with the indexer client."""
        self.config = config
        self.workers = workers
        self.indexers = indexers
        self.router_id = router_id
        self.clock = clock
        self.sync: ReplicaSync | None = None
        # told whenever the load picture loses load (the router queue gives a waiting request a try)
        self.on_capacity: Callable[[], None] = lambda: None
        # what it sees of a misconfigured fleet (the service hands it the metrics' findings)
        self.checks = FleetChecks(Findings(), config.kv_events, clock)
        self.loads = LoadTracker(config.track_active_blocks, config.router_track_output_blocks)
        self.failed = FailedWorkers(config.worker_avoid_secs)
        self.thresholds = BusyThresholds(config.active_decode_blocks_threshold, config.active_prefill_tokens_threshold)
        # what a split adds to time to first token, measured (docs/decisions/0037)
        self.split_overhead = SplitOverhead(config.disagg_split_overhead_ms)
        self._splits: dict[str, tuple[float, float]] = {}  # request id -> (decided at, predicted prefill ms)
        self._rng = rng or random.Random(config.seed)
        self._policies: dict[tuple[int, str], RoutingPolicy] = {}  # by (block size, mode)
        self._approximate: dict[int, ApproximateIndex] = {}
        # kv mode: blocks a worker was just sent, held until its KV events can have reached the indexers
        self._predicted: dict[int, PredictedBlocks] = {}  # by block size
        self._timing_seen: dict[int, object] = {}  # worker -> the advertised constants last adopted

    def policies(self) -> list[RoutingPolicy]:
        return list(self._policies.values())

    def avoid(self, worker_id: int) -> None:
        """Do not choose this worker for ``--worker-avoid-secs`` (its stream just broke)."""
        self.failed.mark(worker_id, self.clock())

    def approximate_index(self, block_size: int) -> ApproximateIndex:
        """Approximate mode's view of the caches of workers with this block size."""
        index = self._approximate.get(block_size)
        if index is None:
            index = self._approximate[block_size] = ApproximateIndex(
                block_size, self.config.router_ttl_secs, self.config.router_max_tree_size
            )
        return index

    def predict(self, worker: InstanceRecord, block_hashes: Sequence[int], overlap: int = 0, dp_rank: int = 0) -> None:
        """Predict-on-route: ``worker`` is taken to cache these blocks for ``--router-predicted-ttl-secs``
        (its KV events take longer than a burst of siblings takes to arrive). The indexers' view wins
        once it holds as much (a match is the larger of the two); the prediction then expires. Nothing
        is predicted where the worker's known match (``overlap``) already covers every block."""
        ttl = self.config.router_predicted_ttl_secs
        if ttl <= 0 or not self.config.kv_events or overlap >= len(block_hashes):
            return
        predicted = self._predicted.get(worker.block_size)
        if predicted is None:
            predicted = self._predicted[worker.block_size] = PredictedBlocks(ttl)
        predicted.record((worker.instance_id, dp_rank), block_hashes, self.clock())

    def policy(self, worker: InstanceRecord, mode: str | None = None) -> RoutingPolicy:
        """The policy in ``mode`` (default: ``--router-mode``) of workers shaped like ``worker`` (same
        block size). Policies of one block size share its load picture.

        The cost model takes the engine shape (capacity, step token budget) from the first worker of
        that block size it meets: a fleet serving one model is assumed homogeneous.
        """
        config = self.config
        mode = mode or ("kv" if config.router_mode == "direct" else config.router_mode)
        policy = self._policies.get((worker.block_size, mode))
        if policy is None:
            cost_model = make_cost_model(
                config.kv_cost,
                worker.block_size,
                int(worker.extra.get("max_num_batched_tokens", DEFAULT_MAX_BATCHED_TOKENS)),
                worker.capacity_blocks,
            )
            policy = self._policies[(worker.block_size, mode)] = RoutingPolicy(
                mode,
                worker.block_size,
                config.kv_overlap_score_weight,
                config.router_temperature,
                self._rng,
                cost_model,
                active=self.loads.sequences(worker.block_size),
                cache_aware=config.cache_aware_options(),
                moe_score_weight=config.moe_score_weight,
            )
        return policy

    def _adopt_advertised_timing(self, policy: RoutingPolicy, records: list[InstanceRecord]) -> None:
        """Each worker's fitted step-time constants (advertised in discovery) into the ttft cost.
        A request pays an identity check per candidate; a lease refresh (a new record object) pays a
        comparison; the worker's cost is rebuilt only when its constants really changed."""
        cost = policy.cost_model
        if not isinstance(cost, PerWorkerTtftCost):
            return
        for record in records:
            constants = record.extra.get("timing")
            seen = self._timing_seen.get(record.instance_id)
            if constants is None or seen is constants:
                continue
            self._timing_seen[record.instance_id] = constants
            if seen != constants:
                try:
                    cost.set_timing((record.instance_id, 0), from_constants(constants))
                except (KeyError, TypeError, ValueError):
                    log.warning("ignoring unreadable timing constants", worker_id=record.instance_id)

    def worker_left(self, record: InstanceRecord) -> None:
        self.checks.worker_left(record.instance_id)
        self.loads.remove_worker(record.instance_id)
        self._timing_seen.pop(record.instance_id, None)
        for policy in self._policies.values():
            policy.forget((record.instance_id, 0))
            if isinstance(policy.cost_model, PerWorkerTtftCost):
                policy.cost_model.forget((record.instance_id, 0))
        self.failed.forget(record.instance_id)
        for index in (*self._approximate.values(), *self._predicted.values()):
            index.remove_worker(record.instance_id)

    # ---- the decision ----------------------------------------------------------------------
    def prepare(self, request: common_pb2.PreprocessedRequest) -> Prepared:
        registered = self.workers.instances()
        lora = request.lora_name if request.HasField("lora_name") else None
        candidates = whole_request_workers(registered, request.model, self.failed, self.clock(), lora).eligible
        if not candidates:
            if request.model and not any(r.model == request.model for r in registered):
                raise RoutingError(
                    grpc.StatusCode.UNAVAILABLE, f"{NO_WORKER} {self.checks.no_worker_for(request.model, registered)}"
                )
            if lora:
                raise RoutingError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{NO_WORKER} serving LoRA adapter {lora!r} of model {request.model!r} "
                    "(start workers with --lora-adapters naming it)",
                )
            raise RoutingError(grpc.StatusCode.UNAVAILABLE, f"{NO_WORKER} for model {request.model!r}")
        block_size = candidates[0].block_size
        policy = self.policy(candidates[0])
        self._adopt_advertised_timing(policy, candidates)
        local_hashes = local_block_hashes(request.token_ids, block_size, lora)
        expected = request.expected_output_tokens if request.HasField("expected_output_tokens") else 0
        return Prepared(
            candidates,
            {r.instance_id: r for r in candidates},
            policy,
            local_hashes,
            sequence_hashes(local_hashes),
            len(request.token_ids),
            expected,
            request.token_ids,
            request.routing.router_config_override.moe_query,
        )

    def not_busy(self, prepared: Prepared, noun: str = "workers") -> list[InstanceRecord]:
        """The prepared candidates under the busy thresholds; :class:`AllWorkersBusy` when none is.

        Called after the last ``await`` of a decision, so that the check, the choice and the caller's
        :meth:`track_add` run without another request's decision in between: a burst meets the
        thresholds from its first request (each sees the load the ones before it added)."""
        active, thresholds, by_id = prepared.policy.active, self.thresholds, prepared.by_id

        def least_loaded_rank(worker_id: int) -> tuple[int, int]:
            # a worker is busy only when every one of its data-parallel ranks is
            loads = [active.load((worker_id, rank)) for rank in ranks_of(by_id[worker_id].extra)]
            return min(loads, key=lambda load: (thresholds.exceeded(*load), load))

        candidates = not_busy(prepared.candidates, least_loaded_rank, thresholds)
        if not candidates.eligible:
            raise AllWorkersBusy(
                f"all {len(prepared.candidates)} {noun} are busy (over their active block or prefill thresholds)"
            )
        return candidates.eligible

    def busy(self, policy: RoutingPolicy, worker_id: int) -> bool:
        """Over ``--active-decode-blocks-threshold`` or ``--active-prefill-tokens-threshold``."""
        return self.thresholds.exceeded(*policy.active.load((worker_id, 0)))

    async def cache_view(self, prepared: Prepared, *policies: RoutingPolicy) -> CacheView:
        """(matched blocks, tree size) per worker: from the indexers, or approximate mode's memory;
        empty unless one of ``policies`` (default: the prepared one) needs them."""
        if not any(policy.needs_overlaps for policy in policies or (prepared.policy,)):
            return CacheView({}, {})
        if self.config.kv_events:
            view = await self.indexers.find_matches(prepared.block_hashes, prepared.moe_query)
            if view.pooled or view.host or view.disk:
                credits = self.config.tier_credits()
                matched = credited_matches(view.matched, credits, pooled=view.pooled, host=view.host, disk=view.disk)
                view = view._replace(matched=matched)
            # after the await: predictions of decisions made while the indexers answered count too
            predicted = self._predicted.get(prepared.policy.block_size)
            if predicted is not None:
                guessed = predicted.matches(prepared.block_hashes, self.clock())
                if guessed:
                    matched = dict(view.matched)
                    for worker, blocks in guessed.items():
                        matched[worker] = max(matched.get(worker, 0), blocks)
                    view = view._replace(matched=matched)
            return view
        approximate = self.approximate_index(prepared.policy.block_size)
        matched = approximate.find_matches_by_sequence(prepared.block_hashes, self.clock())
        return CacheView(matched, dict(approximate.tree_sizes()))

    async def choose(self, request: common_pb2.PreprocessedRequest, commit: bool = True) -> Choice:
        """Pick the worker for a whole request. ``commit=False`` answers a query (BestWorker)
        without leaving a trace in approximate mode."""
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
            rank = request.routing.dp_rank if request.routing.HasField("dp_rank") else None
            return Choice(record, 0, prepared.block_hashes, rank)

        matched, sizes, moe, *_tiers = await self.cache_view(prepared)
        try:
            candidates = self.not_busy(prepared)  # after the await: see not_busy
        except AllWorkersBusy as busy:
            busy.uncached_tokens = uncached_tokens(prepared, matched)
            raise
        weight, temperature = config_overrides(request)
        active, thresholds = prepared.policy.active, self.thresholds
        decision = prepared.policy.choose(
            # every data-parallel rank is a candidate of its own, unless it is over the thresholds
            [
                (r.instance_id, rank)
                for r in candidates
                for rank in ranks_of(r.extra)
                if not thresholds.exceeded(*active.load((r.instance_id, rank)))
            ],
            prepared.block_hashes,
            prepared.prompt_tokens,
            matched,
            sizes,
            weight,
            temperature,
            prepared.expected_output_tokens,
            tokens=prepared.tokens if prepared.policy.needs_tokens else None,
            now=self.clock(),
            commit=commit,
            moe_hosted=moe_hosted_shares(moe, prepared.moe_query),
            load_tokens=self.adapter_loads(candidates, request),
        )
        chosen = prepared.by_id[decision.worker[0]]
        if commit and not self.config.kv_events:
            self.approximate_index(prepared.policy.block_size).record(
                decision.worker, prepared.local_hashes, prepared.block_hashes, self.clock()
            )
        elif commit:
            self.predict(chosen, prepared.block_hashes, decision.overlap_blocks, decision.worker[1])
        return Choice(chosen, decision.overlap_blocks, prepared.block_hashes, decision.worker[1])

    def adapter_loads(
        self, workers: Sequence[InstanceRecord], request: common_pb2.PreprocessedRequest
    ) -> dict[WorkerKey, int]:
        """``--lora-load-tokens`` for each (worker, rank) that must load the request's adapter first."""
        if not request.HasField("lora_name") or not self.config.lora_load_tokens:
            return {}
        cost = self.config.lora_load_tokens
        return {
            (r.instance_id, rank): cost
            for r in workers
            if must_load(r.extra, request.lora_name)
            for rank in ranks_of(r.extra)
        }

    def has_prefill_workers(self) -> bool:
        """Whether requests may be split now (a prefill worker is registered, or the split is enforced)."""
        return self.config.enforce_disagg or any(r.role == "prefill" for r in self.workers.instances())

    async def plan_prefill(self, request: common_pb2.PreprocessedRequest) -> RemotePrefill | LocalPrefill | None:
        """Where this request prefills while prefill workers exist (see prefill_placement.py);
        None when no prefill worker is registered (or none shares the decode workers' block size):
        the request is routed as an aggregated one."""
        enforce = self.config.enforce_disagg
        registered = self.workers.instances()
        pool: list[InstanceRecord] = []
        if any(r.role == "prefill" for r in registered):
            prepared = self.prepare(request)
            block_size = prepared.policy.block_size
            lora = request.lora_name if request.HasField("lora_name") else None
            pool = prefill_workers(registered, request.model, block_size, self.failed, self.clock(), lora).eligible
            self._adopt_advertised_timing(prepared.policy, pool)  # prefill workers are costed too
        if not pool:
            if enforce:
                raise RoutingError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no prefill worker is available for model {request.model!r} and --enforce-disagg is set",
                )
            return None
        policy = self.policy(prepared.candidates[0], self.config.decode_policy)
        prefill_policy = self.policy(prepared.candidates[0], self.config.prefill_policy)
        matched, sizes, moe, *_tiers = await self.cache_view(prepared, policy, prefill_policy)
        try:
            candidates = self.not_busy(prepared, "decode workers")  # after the await: see not_busy
        except AllWorkersBusy as busy:
            busy.uncached_tokens = uncached_tokens(prepared, matched)
            raise
        weight, temperature = config_overrides(request)
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
                prefill_policy=prefill_policy,
                tokens=prepared.tokens if policy.needs_tokens or prefill_policy.needs_tokens else None,
                now=self.clock(),
                moe_hosted=moe_hosted_shares(moe, prepared.moe_query),
                split_overhead_ms=(
                    self.split_overhead.estimate(self.clock()) if self.config.disagg_split_when == "gain" else None
                ),
            )
        except NoCapacity as exc:
            raise RoutingError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc} and --enforce-disagg is set") from None
        decode = prepared.by_id[placement.decode[0]]
        self.predict(decode, prepared.block_hashes, placement.overlap)
        if placement.prefill is None:
            return LocalPrefill(decode, placement.overlap, prepared.block_hashes, placement.reason)
        prefill = next(r for r in pool if r.instance_id == placement.prefill[0])
        self.predict(prefill, prepared.block_hashes)
        return RemotePrefill(prefill, placement.overlap, decode, prepared.block_hashes, placement.predicted_prefill_ms)

    async def potential_loads(self, request: common_pb2.PreprocessedRequest) -> list[router_pb2.WorkerLoad]:
        prepared = self.prepare(request)
        matched, *_rest = await self.cache_view(prepared)
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

    def load_by_worker(self) -> list[router_pb2.WorkerLoad]:
        """Every registered worker's predicted load now (zero for one with nothing in flight), and
        any load still recorded for a worker that has left."""

        def load(worker: tuple[int, int], prefill: int, decode: int) -> router_pb2.WorkerLoad:
            return router_pb2.WorkerLoad(
                worker_id=worker[0], dp_rank=worker[1], active_prefill_tokens=prefill, active_decode_blocks=decode
            )

        loads = {
            (r.instance_id, rank): load(
                (r.instance_id, rank), *self.loads.sequences(r.block_size).load((r.instance_id, rank))
            )
            for r in self.workers.instances()
            for rank in ranks_of(r.extra)
        }
        for picture in self.loads.pictures():
            for worker in picture.workers():
                if worker not in loads:
                    loads[worker] = load(worker, *picture.load(worker))
        return sorted(loads.values(), key=lambda entry: (entry.worker_id, entry.dp_rank))

    # ---- the load picture, shared with the other replicas ----------------------------------
    def track_add(
        self,
        request_id: str,
        record: InstanceRecord,
        block_hashes: list[int],
        prompt_tokens: int,
        overlap: int,
        expected_output_tokens: int,
        dp_rank: int = 0,
    ) -> None:
        key = (record.instance_id, dp_rank)
        self.checks.sent(record.instance_id)
        self.loads.add(
            request_id,
            key,
            record.block_size,
            block_hashes,
            prompt_tokens,
            overlap,
            expected_output_tokens,
            self.clock(),
        )
        if self.sync is not None:
            self.sync.added(
                request_id, key, record.block_size, block_hashes, prompt_tokens, overlap, expected_output_tokens
            )

    def split_started(
        self, request_id: str, predicted_prefill_ms: float | None, decided_at: float | None = None
    ) -> None:
        """A tracked request was split at ``decided_at`` (default: now): its first token will say what
        the split added (see split_overhead). Its free, or its expiry, forgets it."""
        if predicted_prefill_ms is None:
            return
        self._splits[request_id] = (self.clock() if decided_at is None else decided_at, predicted_prefill_ms)

    def track_first_token(self, request_id: str) -> None:
        split = self._splits.pop(request_id, None)
        if split is not None:
            now = self.clock()
            self.split_overhead.observe((now - split[0]) * 1000.0 - split[1], now)
        self.loads.first_token(request_id)
        if self.sync is not None:
            self.sync.prefill_completed(request_id)
        self.on_capacity()

    def track_free(self, request_id: str) -> None:
        self._splits.pop(request_id, None)
        self.loads.free(request_id)
        if self.sync is not None:
            self.sync.freed(request_id)
        self.on_capacity()

    def apply_remote(self, message: SyncMessage) -> None:
        """Another replica's request event (an ``add`` for a worker we do not know is ignored)."""
        record = self.workers.get(message.worker_id) if message.kind == ADD else None
        self.loads.apply_remote(message, record.block_size if record is not None else None, self.clock())
        if record is not None:  # another replica's decision predicts that worker's cache here too
            self.predict(record, message.block_hashes, message.overlap_blocks, message.dp_rank)
        if message.kind != ADD:
            self.on_capacity()

    def forget_router(self, router_id: str) -> None:
        """A replica went silent: drop every request it had told us about."""
        self.loads.forget_router(router_id)
        self.on_capacity()

    def expire_stale(self) -> None:
        for key in self.loads.expire(self.clock(), self.config.request_timeout_secs):
            self._splits.pop(key, None)
            log.warning("forgot a request routed too long ago", request_id=key)
        # also a safety net: a free the queue was not told of waits at most until this runs
        self.on_capacity()
