"""The first stage of a routing decision: the request as routing reads it, and the workers that may
take it (sans-I/O, clock passed in).

:class:`RouteInput` is the request without its transport: the router service builds one from its
gRPC request, ``kvmesh replay`` from a trace record. :class:`Candidates` applies the eligibility
rules (:mod:`~kvmesh.router.eligibility`) to the registered workers and hashes the prompt once,
into a :class:`Prepared` request the later stages read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import grpc

from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.rpc.grpc_errors import NO_WORKER
from kvmesh.common.rpc.status_error import StatusError
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.wire.disagg import MOVES_BLOCKS_KEY
from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes, token_bytes
from kvmesh.common.wire.worker_key import WorkerKey, keys_of
from kvmesh.router.eligibility import FailedWorkers, prefill_workers, whole_request_workers
from kvmesh.router.fleet_checks import FleetChecks


class RoutingError(StatusError):
    """A request cannot be routed; carries the gRPC status to answer with."""


class WorkerDirectory(Protocol):
    """The registered workers: discovery's watcher in the service, the virtual fleet in the replay."""

    def instances(self) -> list[InstanceRecord]: ...
    def get(self, instance_id: int) -> InstanceRecord | None: ...


@dataclass(frozen=True)
class RouteInput:
    """What routing reads of one request. ``worker_id`` / ``dp_rank``: the worker (and rank) it
    names, if any; ``overlap_score_weight`` / ``temperature``: its per-request overrides;
    ``hashes``: its (local, sequence) block hashes where the caller has them already."""

    model: str
    token_ids: Sequence[int]
    lora: str | None = None
    expected_output_tokens: int = 0
    worker_id: int | None = None
    dp_rank: int | None = None
    overlap_score_weight: float | None = None
    temperature: float | None = None
    moe_query: Sequence[Any] = ()  # items with .layer and .expert (common_pb2.MoeExpert)
    hashes: tuple[list[int], list[int]] | None = None
    session: str = ""  # the session it belongs to (empty: none)

    @classmethod
    def of(cls, request: common_pb2.PreprocessedRequest) -> RouteInput:
        routing = request.routing
        override = routing.router_config_override
        return cls(
            request.model,
            request.token_ids,
            request.lora_name if request.HasField("lora_name") else None,
            request.expected_output_tokens if request.HasField("expected_output_tokens") else 0,
            routing.worker_id if routing.HasField("worker_id") else None,
            routing.dp_rank if routing.HasField("dp_rank") else None,
            override.overlap_score_weight if override.HasField("overlap_score_weight") else None,
            override.router_temperature if override.HasField("router_temperature") else None,
            override.moe_query,
            session=routing.session_id,
        )


@dataclass(frozen=True)
class CandidateTables:
    """What a decision derives from its list of candidate records, built once per list and shared,
    read-only, by the decisions over the same list: each record by id, every data-parallel rank's
    key, and the first ranks of the workers whose engines move cached blocks (between these a prefix
    may be pulled; a worker's moves serve its first rank).

    Why shared: at 256 workers building these per request cost about as much as the routing policy's
    whole choice. ``records`` holds the records, so that the ids that find these tables stay theirs."""

    records: tuple[InstanceRecord, ...]
    by_id: dict[int, InstanceRecord]
    keys: tuple[WorkerKey, ...]
    pullable: frozenset[WorkerKey]

    @classmethod
    def of(cls, records: Sequence[InstanceRecord]) -> CandidateTables:
        keys = tuple(key for r in records for key in keys_of(r.instance_id, r.extra))
        movers = frozenset(keys_of(r.instance_id, r.extra)[0] for r in records if r.extra.get(MOVES_BLOCKS_KEY))
        return cls(tuple(records), {r.instance_id: r for r in records}, keys, movers)


@dataclass
class Prepared:
    """A request's candidates and block hashes, computed once per routing decision."""

    request: RouteInput
    tables: CandidateTables
    local_hashes: list[int]
    block_hashes: list[int]

    @property
    def candidates(self) -> tuple[InstanceRecord, ...]:
        """The workers that may take the request, in the order eligibility listed them."""
        return self.tables.records

    @property
    def block_size(self) -> int:
        return self.candidates[0].block_size

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.token_ids)

    @property
    def by_id(self) -> dict[int, InstanceRecord]:
        """Each candidate by its instance id (shared: read only)."""
        return self.tables.by_id

    @property
    def keys(self) -> tuple[WorkerKey, ...]:
        """Every data-parallel rank of every candidate."""
        return self.tables.keys

    @cached_property
    def tokens(self) -> bytes:
        """The prompt as cache-aware mode's tree holds it (built once, only when asked for)."""
        return token_bytes(self.request.token_ids)


class Candidates:
    """Which registered workers may take a request. Guarantees: :meth:`whole_request` returns at
    least one candidate, all of one block size, or raises :class:`RoutingError` saying why none."""

    def __init__(
        self, workers: WorkerDirectory, failed: FailedWorkers, checks: FleetChecks, clock: Callable[[], float]
    ) -> None:
        self.workers = workers
        self.failed = failed
        self.checks = checks
        self.clock = clock
        self._last = CandidateTables.of([])
        self._ids: tuple[int, ...] = ()

    def whole_request(self, request: RouteInput) -> Prepared:
        registered = self.workers.instances()
        lora = request.lora
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
        if request.hashes is not None:
            local, block_hashes = request.hashes
        else:
            local = local_block_hashes(request.token_ids, candidates[0].block_size, lora)
            block_hashes = sequence_hashes(local)
        return Prepared(request, self._tables(candidates), local, block_hashes)

    def _tables(self, candidates: list[InstanceRecord]) -> CandidateTables:
        """The last decision's tables where its candidates are the same records, in the same order."""
        ids = tuple(map(id, candidates))
        if ids != self._ids:
            self._last, self._ids = CandidateTables.of(candidates), ids
        return self._last

    def prefill_pool(self, prepared: Prepared) -> list[InstanceRecord]:
        """The prefill-role workers that may prefill ``prepared`` for one of its decode candidates
        (none: the request is not split)."""
        registered = self.workers.instances()
        if not any(r.role == "prefill" for r in registered):
            return []
        request = prepared.request
        now = self.clock()
        return prefill_workers(registered, request.model, prepared.block_size, self.failed, now, request.lora).eligible

    def forced(self, prepared: Prepared, direct_mode: bool) -> InstanceRecord | None:
        """The worker the request names (or, in ``direct`` mode, must name); None when it names none
        and need not."""
        worker_id = prepared.request.worker_id
        if worker_id is None:
            if direct_mode:
                raise RoutingError(
                    grpc.StatusCode.INVALID_ARGUMENT, "router mode 'direct' needs routing.worker_id in the request"
                )
            return None
        record = prepared.by_id.get(worker_id) or self._named_despite_failure(prepared, worker_id)
        if record is None:
            raise RoutingError(grpc.StatusCode.NOT_FOUND, f"worker {worker_id} is not registered for this model")
        return record

    def _named_despite_failure(self, prepared: Prepared, worker_id: int) -> InstanceRecord | None:
        """The named worker where only a recent failure left it out of the candidates, else None.

        Why: avoiding a worker whose stream broke lately is for the router's own choices. A client
        that names a worker (a gateway routing itself in ``direct`` mode, a client keeping a
        conversation where its replies are) chose it; refusing the request as naming no registered
        worker, for the avoidance window after one broken stream, was a wrong answer."""
        record = self.workers.get(worker_id)
        if record is None or record.block_size != prepared.block_size:
            return None
        # eligible but for failures: the candidates' one other reason to leave a registered worker out
        request = prepared.request
        kept = whole_request_workers([record], request.model, FailedWorkers(0.0), self.clock(), request.lora).eligible
        return record if kept else None
