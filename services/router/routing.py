"""The routing pipeline of one router replica: four stages, a module each, strung together.

1. candidates (:mod:`~kvmesh.router.candidates`): the workers that may take the request;
2. the cache view (:mod:`~kvmesh.router.cache_view`): an index's answer, tier credits, predictions;
3. the cost and the choice (:mod:`~kvmesh.router.choice`): a worker, or a prefill and a decode;
4. the load picture (:mod:`~kvmesh.router.load_picture`): admission before, the count after.

The synchronous steps (:meth:`~Router.prepare`, :meth:`~Router.decide`, :meth:`~Router.place`) are
the whole decision but the index's answer: ``kvmesh replay`` drives them with its own index's, the
service (:meth:`~Router.choose`, :meth:`~Router.plan_prefill`) with the indexer replicas'.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import grpc
import structlog

from kvmesh.common.core.index_answer import EMPTY_ANSWER, IndexAnswer
from kvmesh.common.core.timing import TimingModel
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.runtime.misconfiguration import Findings
from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.router.cache_view import NO_VIEW, CacheView, CacheViews
from kvmesh.router.candidates import Candidates, Prepared, RouteInput, RoutingError, WorkerDirectory
from kvmesh.router.choice import Choice, Chooser
from kvmesh.router.config import RouterConfig
from kvmesh.router.eligibility import FailedWorkers
from kvmesh.router.fleet_checks import FleetChecks
from kvmesh.router.indexer_client import IndexerClient
from kvmesh.router.load_picture import LoadPicture
from kvmesh.router.load_tracker import LoadTracker
from kvmesh.router.loop_turns import LoopTurns
from kvmesh.router.prefill_job import LocalPrefill, RemotePrefill
from kvmesh.router.prefill_placement import NoCapacity
from kvmesh.router.replica_sync import ReplicaSync
from kvmesh.router.request_queue import AllWorkersBusy
from kvmesh.router.session_affinity import SessionAffinity
from kvmesh.router.split_overhead import SplitOverhead
from kvmesh.router.sync_messages import ADD, SyncMessage

__all__ = ["Choice", "Prepared", "RouteInput", "Router", "RoutingError"]

log = structlog.get_logger(__name__)


class Router:
    """The routing pipeline plus the load picture it relies on. One per router process (and one
    per replay).

    Guarantees: every request it routes is added to the load picture, marked prefill-completed on
    its first token and freed when it ends, in this replica and (with replica sync) in every other.
    """

    def __init__(
        self,
        config: RouterConfig,
        workers: WorkerDirectory,
        indexers: IndexerClient | None,
        router_id: str = "",
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        *,
        checks: FleetChecks | None = None,
        on_capacity: Callable[[], None] = lambda: None,
        prior: TimingModel | None = None,
    ) -> None:
        """``rng`` (tie-breaking, sampling) defaults to one seeded with ``--seed``; the service shares
        it with the indexer client. ``checks``: what it sees of a misconfigured fleet (the service's
        are exported as metrics); ``on_capacity``: told whenever load leaves (the router queue);
        ``prior``: the step times a worker is costed with until it advertises its own."""
        self.config = config
        self.workers = workers
        self.indexers = indexers
        self.router_id = router_id
        self.clock = clock
        self.failed = FailedWorkers(config.worker_avoid_secs)
        self.checks = checks or FleetChecks(Findings(), config.kv_events, clock)
        self.candidates = Candidates(workers, self.failed, self.checks, clock)
        self.cache_views = CacheViews(
            config.tier_credits(),
            config.router_predicted_ttl_secs,
            clock,
            kv_events=config.kv_events,
            approximate_ttl_s=config.router_ttl_secs,
            approximate_max_size=config.router_max_tree_size,
            sessions=SessionAffinity(config.session_affinity_ttl_secs, config.session_block_credit),
        )
        self.picture = LoadPicture(config, clock, on_capacity)
        # only the duplicate penalty reads loop turns: without it nothing is kept
        self.loop_turns = LoopTurns(config.session_loop_secs if config.kv_duplicate_penalty > 0 else 0.0)
        self.chooser = Chooser(config, self.picture.loads, rng or random.Random(config.seed), prior, clock)
        self.sync: ReplicaSync | None = None

    @property
    def loads(self) -> LoadTracker:
        return self.picture.loads

    @property
    def split_overhead(self) -> SplitOverhead:
        return self.picture.split_overhead

    def on_capacity(self) -> None:
        """Load left, or a worker joined: the router queue gives a waiting request a try."""
        self.picture.on_capacity()

    def share_with(self, sync: ReplicaSync) -> None:
        """Keep the load picture in step with the other replicas' (replica sync)."""
        self.sync = sync
        self.picture.announce_to(sync)

    def avoid(self, worker_id: int) -> None:
        """Do not choose this worker for ``--worker-avoid-secs`` (its stream just broke)."""
        self.failed.mark(worker_id, self.clock())

    def worker_left(self, record: InstanceRecord) -> None:
        """Forget every rank of a departed worker, in every stage."""
        self.checks.worker_left(record.instance_id)
        self.picture.worker_left(record.instance_id)
        self.chooser.worker_left(record)
        self.failed.forget(record.instance_id)
        self.cache_views.worker_left(record.instance_id)

    # ---- the decision, without I/O (the replay drives these) --------------------------------
    def prepare(self, request: RouteInput) -> Prepared:
        prepared = self.candidates.whole_request(request)
        self.chooser.policy(prepared.candidates[0])
        self.chooser.adopt_timing(prepared.candidates)
        return prepared

    def needs_answer(self, split: bool = False) -> bool:
        """Whether the decision reads an index's answer (a ``kv`` policy chooses)."""
        config = self.config
        mode = "kv" if config.router_mode == "direct" else config.router_mode
        modes = (config.decode_policy or mode, config.prefill_policy or mode) if split else (mode,)
        return "kv" in modes

    def decide(self, prepared: Prepared, answer: IndexAnswer, *, commit: bool = True, exact: bool = False) -> Choice:
        """The worker for a whole request. ``commit=False`` answers a query (BestWorker) without
        leaving a trace in approximate mode; ``exact``: the answer is exact (the replay's oracle)."""
        view = self.view(prepared, answer, exact=exact)
        try:
            keys = self.picture.admitted(prepared.tables)
        except AllWorkersBusy as busy:
            busy.uncached_tokens = view.uncached_tokens(prepared)
            raise
        now = self.clock()
        loop_turn = self.loop_turn(prepared, now)
        sessions = self.cache_views.sessions
        new_session = sessions.starts(prepared.request.session, now)
        # where sessions are parked weighs only in placing a new one (decision 72)
        parked = sessions.parked(now) if new_session and self.config.session_spread_ms else None
        choice = self.chooser.choose(
            prepared, view, keys, commit=commit, now=now, loop_turn=loop_turn, new_session=new_session, parked=parked
        )
        if commit:
            self.cache_views.routed(choice.key, prepared, choice.overlap_blocks)
            self.loop_turns.routed(prepared.block_hashes, now, max(view.matched.values(), default=0))
        return choice

    def place(
        self, prepared: Prepared, pool: list[InstanceRecord], answer: IndexAnswer, *, exact: bool = False
    ) -> RemotePrefill | LocalPrefill:
        """Where a request prefills while prefill workers (``pool``) may take it."""
        view = self.view(prepared, answer, split=True, exact=exact)
        try:
            admitted = self.picture.admitted(prepared.tables, "decode workers")
        except AllWorkersBusy as busy:
            busy.uncached_tokens = view.uncached_tokens(prepared)
            raise
        # a split request runs on each worker's first rank: a worker's KV handoff is its rank 0's
        keys = [WorkerKey(worker_id, 0) for worker_id in dict.fromkeys(key.worker_id for key in admitted)]
        block_size, enforce = prepared.block_size, self.config.enforce_disagg
        now = self.clock()
        try:
            plan = self.chooser.place(
                prepared,
                view,
                keys,
                pool,
                busy=lambda key: self.picture.busy(key, block_size),
                split_overhead_ms=self.picture.split_overhead_ms(),
                enforce=enforce,
                now=now,
                loop_turn=self.loop_turn(prepared, now),
            )
        except NoCapacity as exc:
            raise RoutingError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc} and --enforce-disagg is set") from None
        # the decode worker will hold the prompt's blocks (computed there, or moved there): predicted
        # unless its own known match covers them already
        decode = WorkerKey(plan.decode.instance_id, plan.decode_rank)
        self.cache_views.predict(decode, block_size, plan.block_hashes, view.matched.get(decode, 0))
        self.cache_views.sessions.routed(prepared.request.session, decode, plan.block_hashes, self.clock())
        self.loop_turns.routed(plan.block_hashes, now, max(view.matched.values(), default=0))
        if isinstance(plan, RemotePrefill):
            prefill = WorkerKey(plan.prefill.instance_id, plan.prefill_rank)
            self.cache_views.predict(prefill, block_size, plan.block_hashes, view.matched.get(prefill, 0))
        return plan

    def loop_turn(self, prepared: Prepared, now: float) -> bool:
        """Whether ``prepared`` continues a loop (``--session-loop-secs``): its session's last turn, or
        for a request that names none, a prompt it extends, was routed that recently. The duplicate
        penalty holds a prefix where it is for later requests, but a loop's turns come seconds apart
        and each waits on the last, so holding them on a busy holder queues the loop behind itself
        (agent loops' TTFT p99 1.5-5x with the penalty, within noise of none without; decision 48)."""
        session = prepared.request.session
        if session and self.cache_views.sessions.enabled:
            return self.cache_views.sessions.continues_loop(session, now, self.config.session_loop_secs)
        return self.loop_turns.continues(prepared.block_hashes, now)

    def view(self, prepared: Prepared, answer: IndexAnswer, *, split: bool = False, exact: bool = False) -> CacheView:
        """What the router takes each candidate to hold of ``prepared`` (nothing where no policy reads it)."""
        if not self.needs_answer(split):
            return NO_VIEW
        return self.cache_views.of(prepared, answer, predictions=not exact)

    # ---- the service's decisions: the same steps around the indexers' answer ----------------
    async def answer(self, prepared: Prepared, split: bool = False) -> IndexAnswer:
        """The indexer replicas' answer for ``prepared`` (empty when no policy reads one, or in
        approximate mode, whose view is the router's own memory)."""
        if not self.needs_answer(split) or not self.config.kv_events or self.indexers is None:
            return EMPTY_ANSWER
        return await self.indexers.find_matches(prepared.block_hashes, prepared.request.moe_query)

    async def choose(self, request: common_pb2.PreprocessedRequest, commit: bool = True) -> Choice:
        """Pick the worker for a whole request."""
        prepared = self.prepare(RouteInput.of(request))
        forced = self.candidates.forced(prepared, self.config.router_mode == "direct")
        if forced is not None:
            rank = prepared.request.dp_rank
            return Choice(forced, await self._held_at(prepared, forced, rank), prepared.block_hashes, rank)
        answer = await self.answer(prepared)
        return self.decide(prepared, answer, commit=commit)  # after the await: see LoadPicture.admitted

    async def _held_at(self, prepared: Prepared, worker: InstanceRecord, rank: int | None) -> int:
        """The prefix of ``prepared`` the named ``worker`` (its rank ``rank``; None: its best rank)
        holds, as a policy that reads the index sees it (0 where none does).

        Why: the load picture counts a request's prompt beyond this as prefill queued there. Counted
        as wholly uncached, a named request on a worker that holds its prefix (a client keeping a
        conversation's replies where they were decoded, a gateway that picks workers itself) made that
        worker look seconds behind, and the next turn of the session was moved off it (docs/perf,
        2026-12-04: predicted 1,219 ms at the median where requests sent there meanwhile took 246)."""
        matched = self.view(prepared, await self.answer(prepared)).matched
        if rank is not None:
            return matched.get(WorkerKey(worker.instance_id, rank), 0)
        return max((blocks for key, blocks in matched.items() if key[0] == worker.instance_id), default=0)

    async def plan_prefill(self, request: common_pb2.PreprocessedRequest) -> RemotePrefill | LocalPrefill | None:
        """Where this request prefills while prefill workers exist (see prefill_placement.py);
        None when no prefill worker is registered (or none shares the decode workers' block size):
        the request is routed as an aggregated one."""
        pool: list[InstanceRecord] = []
        if any(r.role == "prefill" for r in self.workers.instances()):
            prepared = self.prepare(RouteInput.of(request))
            pool = self.candidates.prefill_pool(prepared)
        if not pool:
            if self.config.enforce_disagg:
                raise RoutingError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no prefill worker is available for model {request.model!r} and --enforce-disagg is set",
                )
            return None
        answer = await self.answer(prepared, split=True)
        return self.place(prepared, pool, answer)

    async def potential_loads(self, request: common_pb2.PreprocessedRequest) -> list[router_pb2.WorkerLoad]:
        """Each candidate's load if ``request`` were added to it (the ``PotentialLoads`` query)."""
        prepared = self.prepare(RouteInput.of(request))
        return self.picture.potential_loads(prepared, self.view(prepared, await self.answer(prepared)))

    def load_by_worker(self) -> list[router_pb2.WorkerLoad]:
        """Every registered worker's predicted load now (see :meth:`LoadPicture.loads_of`)."""
        return self.picture.loads_of(self.workers.instances())

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
        now: float | None = None,
        session: str = "",
    ) -> None:
        """A request (of ``session``) was routed to ``record``'s rank ``dp_rank`` (at ``now``,
        default the clock's); with replica sync the other replicas learn it, its session too."""
        self.checks.sent(record.instance_id)
        key = WorkerKey(record.instance_id, dp_rank)
        self.picture.add(
            request_id,
            key,
            record.block_size,
            block_hashes,
            prompt_tokens,
            overlap,
            expected_output_tokens,
            now,
            session,
        )

    def apply_remote(self, message: SyncMessage) -> None:
        """Another replica's request event (an ``add`` for a worker we do not know is ignored)."""
        record = self.workers.get(message.worker_id) if message.kind == ADD else None
        self.picture.apply_remote(message, record.block_size if record is not None else None)
        if record is not None:  # another replica's decision predicts that worker's cache here too
            key = WorkerKey(message.worker_id, message.dp_rank)
            self.cache_views.predict(key, record.block_size, message.block_hashes, message.overlap_blocks)
            self.cache_views.sessions.routed(message.session, key, message.block_hashes, self.clock())
            self.loop_turns.routed(message.block_hashes, self.clock(), message.overlap_blocks)
        if message.kind != ADD:
            self.picture.on_capacity()

    def expire_stale(self) -> None:
        for key in self.picture.expire(self.config.request_timeout_secs):
            log.warning("forgot a request routed too long ago", request_id=key)
