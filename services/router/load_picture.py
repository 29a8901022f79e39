"""The fourth stage of a routing decision: the load picture it leaves behind, and admission
(sans-I/O, clock passed in).

Every request routed is counted on its (worker, rank) from routing through its first token to its
end (:class:`~kvmesh.router.load_tracker.LoadTracker`), and with replica sync announced to the other
router replicas. The busy thresholds (``--active-decode-blocks-threshold``,
``--active-prefill-tokens-threshold``) read the picture to admit a request now or leave it to the
router queue. A split request's first token measures what the split added (docs/decisions/0037).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvmesh.common.proto.kvmesh.v1 import router_pb2
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.wire.worker_key import WorkerKey, keys_of
from kvmesh.router.active_sequences import ActiveSequences
from kvmesh.router.cache_view import CacheView
from kvmesh.router.candidates import CandidateTables, Prepared
from kvmesh.router.config import RoutingOptions
from kvmesh.router.eligibility import BusyThresholds, not_busy
from kvmesh.router.load_tracker import LoadTracker
from kvmesh.router.request_queue import AllWorkersBusy
from kvmesh.router.split_overhead import SplitOverhead
from kvmesh.router.sync_messages import SyncMessage


class LoadAnnouncer(Protocol):
    """Where this replica's request events go besides its own picture (replica sync)."""

    def added(
        self,
        request_id: str,
        worker: WorkerKey,
        block_size: int,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        overlap_blocks: int,
        expected_output_tokens: int,
        session: str = "",
    ) -> None: ...
    def prefill_completed(self, request_id: str) -> None: ...
    def freed(self, request_id: str) -> None: ...


class LoadPicture:
    """Guarantees: every request added is counted until it is freed, expired, forgotten with its
    router or dropped with its worker, here and (announced) in every other replica; whenever load
    leaves, ``on_capacity`` is told (the router queue gives a waiting request a try)."""

    def __init__(
        self,
        options: RoutingOptions,
        clock: Callable[[], float],
        on_capacity: Callable[[], None] = lambda: None,
    ) -> None:
        self.clock = clock
        self.on_capacity = on_capacity
        self.loads = LoadTracker(options.track_active_blocks, options.router_track_output_blocks)
        self.thresholds = BusyThresholds(
            options.active_decode_blocks_threshold, options.active_prefill_tokens_threshold
        )
        # what a split adds to time to first token, measured (docs/decisions/0037)
        self.split_overhead = SplitOverhead(options.disagg_split_overhead_ms)
        self.split_when = options.disagg_split_when
        self.announcer: LoadAnnouncer | None = None
        self._splits: dict[str, tuple[float, float]] = {}  # request id -> (decided at, predicted prefill ms)

    def announce_to(self, announcer: LoadAnnouncer) -> None:
        """Announce this replica's request events to the other replicas (replica sync) from now on."""
        self.announcer = announcer

    # ---- admission -------------------------------------------------------------------------
    def busy(self, key: WorkerKey, block_size: int) -> bool:
        """Over ``--active-decode-blocks-threshold`` or ``--active-prefill-tokens-threshold``."""
        return self.thresholds.exceeded(*self.loads.sequences(block_size).load(key))

    def admitted(self, tables: CandidateTables, noun: str = "workers") -> Sequence[WorkerKey]:
        """Every rank of the candidates (``tables.keys``), once some worker is under the busy
        thresholds; :class:`AllWorkersBusy` while none is (the request waits in the router queue).

        The thresholds decide *when* a request is routed, not *where*: a busy worker's load is in its
        cost already, and leaving it out sends a request away from the worker that holds its prefix
        (docs/decisions/0045). Called after the last ``await`` of a decision, so that the check, the
        choice and the :meth:`add` run without another request's decision in between: a burst meets
        the thresholds from its first request (each sees the load the ones before it added)."""
        keys, candidates = tables.keys, tables.records
        thresholds = self.thresholds
        if not candidates or (thresholds.active_decode_blocks is None and thresholds.active_prefill_tokens is None):
            return keys
        active = self.loads.sequences(candidates[0].block_size)
        by_id = tables.by_id

        def least_loaded_rank(worker_id: int) -> tuple[int, int]:
            # a worker is busy only when every one of its data-parallel ranks is
            loads = [active.load(key) for key in keys_of(worker_id, by_id[worker_id].extra)]
            return min(loads, key=lambda load: (thresholds.exceeded(*load), load))

        if not not_busy(candidates, least_loaded_rank, thresholds).eligible:
            raise AllWorkersBusy(
                f"all {len(candidates)} {noun} are busy (over their active block or prefill thresholds)"
            )
        return keys

    def split_overhead_ms(self) -> float | None:
        """What a split is taken to add now (None: ``--disagg-split-when always``, split regardless)."""
        return self.split_overhead.estimate(self.clock()) if self.split_when == "gain" else None

    # ---- this replica's requests -----------------------------------------------------------
    def add(
        self,
        request_id: str,
        key: WorkerKey,
        block_size: int,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        overlap: int,
        expected_output_tokens: int,
        now: float | None = None,
        session: str = "",
    ) -> None:
        """A request was routed to ``key`` (at ``now``, default the clock's now)."""
        now = self.clock() if now is None else now
        self.loads.add(request_id, key, block_size, block_hashes, prompt_tokens, overlap, expected_output_tokens, now)
        if self.announcer is not None:
            self.announcer.added(
                request_id, key, block_size, block_hashes, prompt_tokens, overlap, expected_output_tokens, session
            )

    def split_started(self, request_id: str, predicted_prefill_ms: float | None, decided_at: float) -> None:
        """A tracked request was split at ``decided_at``: its first token will say what the split
        added. Its free, or its expiry, forgets it."""
        if predicted_prefill_ms is not None:
            self._splits[request_id] = (decided_at, predicted_prefill_ms)

    def first_token(self, request_id: str) -> None:
        now = self.clock()
        split = self._splits.pop(request_id, None)
        if split is not None:
            self.split_overhead.observe((now - split[0]) * 1000.0 - split[1], now)
        self.loads.first_token(request_id, now)
        if self.announcer is not None:
            self.announcer.prefill_completed(request_id)
        self.on_capacity()

    def free(self, request_id: str, output_tokens: int = 0) -> None:
        """The request ended, having produced ``output_tokens`` (0: not said; with them its worker's
        decode pace is measured, see :mod:`~kvmesh.router.decode_pace`)."""
        self._splits.pop(request_id, None)
        self.loads.free(request_id, self.clock(), output_tokens)
        if self.announcer is not None:
            self.announcer.freed(request_id)
        self.on_capacity()

    # ---- other replicas, departures, expiry ------------------------------------------------
    def apply_remote(self, message: SyncMessage, block_size: int | None) -> None:
        """Another replica's request event (an ``add`` for a worker this one does not know is ignored)."""
        self.loads.apply_remote(message, block_size, self.clock())

    def forget_router(self, router_id: str) -> None:
        """A replica went silent: drop every request it had told us about."""
        self.loads.forget_router(router_id)
        self.on_capacity()

    def worker_left(self, worker_id: int) -> None:
        self.loads.remove_worker(worker_id)

    def expire(self, max_age_s: float) -> list[str]:
        """Forget requests routed longer ago than ``max_age_s`` (a lost free); their ids."""
        expired = self.loads.expire(self.clock(), max_age_s)
        for key in expired:
            self._splits.pop(key, None)
        # also a safety net: a free the queue was not told of waits at most until this runs
        self.on_capacity()
        return expired

    # ---- what it shows ---------------------------------------------------------------------
    def potential_loads(self, prepared: Prepared, view: CacheView) -> list[router_pb2.WorkerLoad]:
        """Each candidate rank's load now and if ``prepared`` were added to it."""
        active = self.sequences(prepared.block_size)
        loads = []
        expected = prepared.request.expected_output_tokens
        for load in active.potential_loads(
            prepared.keys, prepared.block_hashes, prepared.prompt_tokens, view.matched, expected
        ):
            now_prefill, now_decode = active.load(load.worker)
            loads.append(
                router_pb2.WorkerLoad(
                    worker_id=load.worker[0],
                    dp_rank=load.worker[1],
                    overlap_blocks=view.matched.get(load.worker, 0),
                    potential_prefill_tokens=load.prefill_tokens,
                    potential_decode_blocks=load.decode_blocks,
                    active_prefill_tokens=now_prefill,
                    active_decode_blocks=now_decode,
                )
            )
        return loads

    def loads_of(self, workers: Sequence[InstanceRecord]) -> list[router_pb2.WorkerLoad]:
        """Every rank of ``workers`` with its predicted load now (zero for one with nothing in
        flight), and any load still recorded for a worker that has left."""

        def load(worker: WorkerKey, prefill: int, decode: int) -> router_pb2.WorkerLoad:
            return router_pb2.WorkerLoad(
                worker_id=worker[0], dp_rank=worker[1], active_prefill_tokens=prefill, active_decode_blocks=decode
            )

        loads = {
            key: load(key, *self.sequences(r.block_size).load(key))
            for r in workers
            for key in keys_of(r.instance_id, r.extra)
        }
        for picture in self.loads.pictures():
            for worker in picture.workers():
                if worker not in loads:
                    loads[worker] = load(worker, *picture.load(worker))
        return sorted(loads.values(), key=lambda entry: (entry.worker_id, entry.dp_rank))

    def sequences(self, block_size: int) -> ActiveSequences:
        return self.loads.sequences(block_size)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.loads
