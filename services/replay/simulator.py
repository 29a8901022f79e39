"""Virtual-time replay of a request trace through the real routing, indexing and engine code.

Nothing here sleeps, sockets or threads: a heap of step completions and a sorted list of arrivals
drive N :class:`MockEngine` instances, the router service's own routing pipeline
(:class:`~kvmesh.router.routing.Router`: candidates, cache view, cost and choice, load picture) and
an index fed by the engines' KV events (:mod:`~kvmesh.replay.virtual_index`), exactly as the
services would, but as fast as the CPU allows. Every routing option of the replay is the router's
own and takes effect as it does there (or is refused: :func:`refused_options`).

With ``prefill_workers`` the replay disaggregates as the router does (``Router.place``, the same
code): a remote prefill runs on a prefill engine with ``max_tokens = 1`` and holds its blocks;
when it ends, the decode engine reserves blocks for the prompt, the KV transfer takes
``blocks × block_size × kv_bytes_per_token / kv_transfer_gbps``, then the decode engine runs the
request from there and the prefill engine releases its blocks.

A request the router tells to pull its prefix (``--kv-pull-ratio``, docs/decisions/0070) waits for
the blocks its holder caches at that moment to cross the same KV transfer; they are then cached on
its worker as if computed there (its KV events tell the index), and the request runs from there.

Timeline rules (the same as the live worker's engine loop): a step's scheduling happens when it
starts, its tokens and KV events become visible when it ends, and a worker starts its next step as
soon as the previous one ends while it has work. An arrival at the same instant as a step's end is
routed after that step's events are applied.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random

from kvmesh.common.core.index_answer import EMPTY_ANSWER, IndexAnswer
from kvmesh.common.core.timing import TimingModel, scaled
from kvmesh.common.core.timing_fit import TimingFit
from kvmesh.common.wire.hashing import sequence_hashes
from kvmesh.common.wire.kv_events import HOST_TIER, KvEvent, KvEventBatch
from kvmesh.common.wire.priority import parse_mix
from kvmesh.common.wire.worker_key import WorkerKey
from kvmesh.planner.decision import Decision
from kvmesh.planner.load import IntervalObservation
from kvmesh.planner.planner import Planner
from kvmesh.replay.arrival_profile import parse_arrival_profile
from kvmesh.replay.config import TOO_LONG, ReplayConfig, RequestRecord, router_config
from kvmesh.replay.elastic import ElasticFleet
from kvmesh.replay.fleet import REPLAY_MODEL, RoutableWorkers, VirtualFleet
from kvmesh.replay.handoff import Handoff, Warmup
from kvmesh.replay.mooncake_trace import PromptBuilder, TraceRequest
from kvmesh.replay.queue_door import QueueDoor
from kvmesh.replay.replies import ReplyCache
from kvmesh.replay.virtual_index import VirtualIndex
from kvmesh.router.candidates import CandidateTables, Prepared, RouteInput
from kvmesh.router.prefill_job import LocalPrefill
from kvmesh.router.request_queue import AllWorkersBusy
from kvmesh.router.routing import Router
from kvmesh.worker.engine import EngineRequestSpec
from kvmesh.worker.engines.mock.block_moves import Block
from kvmesh.worker.engines.mock.mock_engine import EngineConfig, MockEngine, StepResult, capacity_refusal


class ReplaySimulator(ElasticFleet):
    """Replays one trace once. Guarantees: every request completes (or the run raises)."""

    def __init__(self, config: ReplayConfig) -> None:
        self.config = config
        engine_config = EngineConfig(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            timing=TimingModel(),
            host_blocks=config.host_kv_blocks,
        )
        total = config.workers + config.prefill_workers
        self.engine_config = engine_config
        slow = dataclasses.replace(engine_config, timing=scaled(TimingModel(), config.slow_worker_factor))
        self.engines = [MockEngine(slow if w < config.slow_workers else engine_config) for w in range(total)]
        # the router service's own pipeline, on the replay's clock and workers
        self.now_ms = 0.0
        self.workers = RoutableWorkers(config.block_size, config.num_blocks, config.max_num_batched_tokens)
        for w in range(total):
            self.workers.join(w, self._pool_of(w))
        prior = scaled(TimingModel(), config.router_prefill_scale, config.router_decode_scale)
        self.router = Router(
            router_config(config),
            self.workers,
            None,
            router_id="replay",
            clock=lambda: self.now_ms / 1000.0,
            rng=random.Random(config.seed),
            prior=prior,
        )
        self.index = VirtualIndex(config.kv_event_delay_ms)
        # the router queue (--active-*-threshold, --router-queue-*), as the live router keeps it
        self.queue = QueueDoor(config.queue_config(), self._all_busy, self._uncached_tokens)
        self._fits = [TimingFit(prior) for _ in range(total)] if config.router_timing == "learned" else []
        if config.router_timing == "exact":
            for w, engine in enumerate(self.engines):
                self.router.chooser.set_timing(WorkerKey(w, 0), engine.config.timing)
        self._builder = PromptBuilder(config.trace_block_size, config.block_size)
        self._replies: ReplyCache | None = None  # with --cache-replies, set for the trace being run
        self.replies_cached = 0  # blocks cached on the workers that decoded them (--cache-replies)
        self._next_event_id = [0] * total
        self._next_host_event_id = [0] * total  # each worker's host tier numbers its own events
        # prefill request id -> (request id, decode worker, prompt, output length, (local, sequence) hashes)
        self._awaiting_kv: dict[str, tuple[str, int, list[int], int, tuple[list[int], list[int]]]] = {}
        self._transfers: list[tuple[float, int, str, int, int]] = []  # (done at, seq, request id, decode, prefill)
        self._transfer_seq = itertools.count()
        # prefix pulls in flight: (done at, seq, worker, request, its hashes, the blocks pulled)
        self._pulls: list[tuple[float, int, int, EngineRequestSpec, tuple[list[int], list[int]], list[Block]]] = []
        # with --planner: the fleet it scales, its decisions, and the events it schedules
        self.planner: Planner | None = None
        self.handoffs: dict[int, Handoff] = {}  # leaving worker -> the blocks it is sending
        self.handed_on = 0  # blocks cached on survivors by handoffs
        self.handoff_ends: dict[int, float] = {}  # leaving worker -> when its last block arrived
        self.warmups: dict[int, Warmup] = {}  # started worker -> the blocks it imports before it serves
        self.warmed = 0  # blocks cached on started workers before they served
        self.warm_joins: dict[int, float] = {}  # warmed worker -> when it registered, its import arrived
        self.fleet: VirtualFleet | None = None
        self.decisions: list[Decision] = []
        self.steps: list[tuple[IntervalObservation, Decision]] = []
        self.looks: list[dict[str, float]] = []  # growths between decisions: t_s, workers, target
        # (at, seq, "tick" | "look" | "join" | "warm" | "handoff", worker)
        self._timers: list[tuple[float, int, str, int]] = []

    @property
    def loads(self):
        """The router's load picture (what the planner's observations read)."""
        return self.router.loads

    def attach_planner(self, planner: Planner) -> None:
        """Let ``planner`` size the fleet during :meth:`run` (the virtual connector): the aggregated
        pool, or with ``--prefill-workers`` the prefill and decode pools."""
        if planner.disaggregated != bool(self.config.prefill_workers):
            raise ValueError("a disaggregated replay (--prefill-workers) needs a disaggregated planner, and only it")
        self.planner = planner
        self.fleet = VirtualFleet(self.config.join_secs() * 1000.0)
        for worker in range(len(self.engines)):
            self.fleet.start(worker, self._pool_of(worker), 0.0, immediately=True)

    def _pool_of(self, worker: int) -> str:
        """The pool of one of the workers the replay starts with."""
        if not self.config.prefill_workers:
            return "aggregated"
        return "prefill" if worker >= self.config.workers else "decode"

    def run(self, trace: list[TraceRequest]) -> list[RequestRecord]:
        speedup = self.config.arrival_speedup_ratio
        profile = parse_arrival_profile(self.config.arrival_profile)
        records = [
            RequestRecord(
                i,
                profile.warp_ms(r.timestamp_ms / speedup) if profile else r.timestamp_ms / speedup,
                r.input_length,
                r.output_length,
                session=r.session or "",
            )
            for i, r in enumerate(trace)
        ]
        if self.config.priority_mix:
            mix = parse_mix(self.config.priority_mix)
            draw = random.Random(self.config.seed)
            for record in records:
                record.priority = draw.choices(list(mix), weights=list(mix.values()))[0]
        self.records = records
        self._trace = trace
        self._replies = ReplyCache(trace, self._builder) if self.config.cache_replies else None
        if self.planner is not None:
            self._schedule("tick", self.config.adjustment_interval * 1000.0)
            self._schedule_looks(0.0)
        by_id: dict[str, RequestRecord] = {}
        completions: list[tuple[float, int, int]] = []  # (end time, tie-breaker, worker)
        in_flight: dict[int, StepResult] = {}
        sequence = 0

        def start_step(worker: int, now: float) -> None:
            nonlocal sequence
            result = self.engines[worker].step()
            if not result.outputs and result.duration_ms <= 0:
                raise RuntimeError(f"worker {worker} made no progress at t={now:.3f} ms")
            in_flight[worker] = result
            sequence += 1
            heapq.heappush(completions, (now + result.duration_ms, sequence, worker))

        next_arrival = 0
        while next_arrival < len(trace) or completions or self._transfers or self.handoffs or self._pulls:
            arrival_time = records[next_arrival].arrival_ms if next_arrival < len(trace) else math.inf
            transfer_time = self._transfers[0][0] if self._transfers else math.inf
            timer_time = self._timers[0][0] if self._timers else math.inf
            pull_time = self._pulls[0][0] if self._pulls else math.inf
            if pull_time < min(arrival_time, transfer_time, timer_time) and (
                not completions or pull_time < completions[0][0]
            ):
                self.now_ms, _, worker, spec, hashes, blocks = heapq.heappop(self._pulls)
                self.engines[worker].adopt_blocks(blocks)
                self.engines[worker].add_request(spec, block_hashes=hashes)
                if worker not in in_flight:
                    start_step(worker, self.now_ms)
                continue
            if timer_time <= min(arrival_time, transfer_time) and (not completions or timer_time < completions[0][0]):
                self.now_ms, _, kind, worker = heapq.heappop(self._timers)
                self._on_timer(kind, worker, self.now_ms, next_arrival < len(trace) or bool(completions))
                continue
            if transfer_time <= arrival_time and (not completions or transfer_time < completions[0][0]):
                self.now_ms, _, request_id, decode, prefill = heapq.heappop(self._transfers)
                self.engines[prefill].release_held(f"{request_id}:p")
                self.engines[decode].finish_transfer(request_id, True)
                if decode not in in_flight:
                    start_step(decode, self.now_ms)
                continue
            if completions and completions[0][0] <= arrival_time:
                now, _, worker = heapq.heappop(completions)
                self.now_ms = now
                for decode in self._finish_step(worker, in_flight.pop(worker), now, by_id):
                    if decode not in in_flight and self.engines[decode].has_work():
                        start_step(decode, now)
                if worker not in in_flight and self.engines[worker].has_work():
                    start_step(worker, now)
                elif worker not in in_flight:
                    self._stop_if_drained(worker, now)
                # capacity freed: waiting requests get their turn
                for waited in self.queue.release(now):
                    routed = self._route(waited, trace[waited.index], by_id, now)
                    if routed not in in_flight and self.engines[routed].has_work():
                        start_step(routed, now)
                continue
            record = records[next_arrival]
            request = trace[next_arrival]
            next_arrival += 1
            self.now_ms = record.arrival_ms
            tokens = request.input_length + request.output_length
            if capacity_refusal(tokens, self.config.block_size, self.config.num_blocks) is not None:
                # no worker can hold it: a worker refuses it (the frontend answers 400), counted, not run
                record.refused = TOO_LONG
                continue
            if not self.queue.admit_now(record):
                continue  # waits in the router queue, or was refused
            worker = self._route(record, request, by_id)
            if worker not in in_flight and self.engines[worker].has_work():  # not while it waits for a pull
                start_step(worker, record.arrival_ms)
        if len(self.queue):
            raise RuntimeError(f"{len(self.queue)} requests were left in the router queue")
        return records

    # ---- the router queue -------------------------------------------------------------------
    def _all_busy(self) -> bool:
        """Every worker the router may send a whole request to is over a busy threshold."""
        try:
            self.router.picture.admitted(CandidateTables.of(self.workers.of_role("aggregated", "decode")))
        except AllWorkersBusy:
            return True
        return False

    def _uncached_tokens(self, record: RequestRecord) -> int:
        """A request's prompt past the longest cached prefix the router's view holds now."""
        prepared = self._prepare(self._trace[record.index])
        split = bool(self.config.prefill_workers)
        view = self.router.view(prepared, self._answer(prepared, split), split=split, exact=self.config.oracle_index)
        return view.uncached_tokens(prepared)

    def _publish_events(self, worker: int, now: float) -> None:
        """The worker's device-tier KV events since the last call, to the index."""
        events = self.engines[worker].drain_events()
        if events:
            first = self._next_event_id[worker]
            self._next_event_id[worker] = first + len(events)
            batch = tuple(KvEvent(first + i, data) for i, data in enumerate(events))
            self.index.publish(KvEventBatch(worker, 0, now, batch), now)

    # ---- routing: the router's pipeline, the replay's index ------------------------------------
    def _prepare(self, request: TraceRequest) -> Prepared:
        prompt = self._builder.tokens(request)
        local = self._builder.local_hashes(request, prompt)
        # the request says its output length, as a client may (kvmesh.expected_output_tokens): the
        # router counts it only with --router-track-output-blocks
        route = RouteInput(
            REPLAY_MODEL,
            prompt,
            expected_output_tokens=request.output_length,
            hashes=(local, sequence_hashes(local)),
            session=request.session or "",
        )
        return self.router.prepare(route)

    def _answer(self, prepared: Prepared, split: bool) -> IndexAnswer:
        """What the indexers answer for ``prepared`` now (nothing, where no policy reads it)."""
        if not self.router.needs_answer(split):
            return EMPTY_ANSWER
        if self.config.oracle_index:
            routable = [WorkerKey(r.instance_id, 0) for r in self.workers.instances()]
            return self.index.oracle(prepared.block_hashes, routable, self.engines.__getitem__)
        return self.index.answer(prepared.block_hashes, self.now_ms)

    def _route(
        self, record: RequestRecord, request: TraceRequest, by_id: dict[str, RequestRecord], at_ms: float | None = None
    ) -> int:
        """Route ``record`` at ``at_ms`` (its arrival, or when the router queue let it go); the worker
        that runs it first."""
        self.now_ms = record.arrival_ms if at_ms is None else at_ms
        prepared = self._prepare(request)
        request_id = f"r{record.index}"
        by_id[request_id] = record
        pool = self.router.candidates.prefill_pool(prepared) if self.config.prefill_workers else []
        exact = self.config.oracle_index
        if pool:
            return self._route_split(record, request_id, prepared, pool, exact)
        choice = self.router.decide(prepared, self._answer(prepared, split=False), exact=exact)
        worker = choice.worker.instance_id
        spec = EngineRequestSpec(request_id, prepared.request.token_ids, request.output_length)
        hashes = (prepared.local_hashes, prepared.block_hashes)
        pull = choice.pull_order()
        # what the holder caches now is held for the pull (an offer), and arrives after the transfer
        blocks = self.engines[choice.pull_from.instance_id].cached_prefix(pull.sequence_hashes) if pull else []
        if blocks:
            record.pulled_tokens = len(blocks) * self.config.block_size
            done_ms = self.now_ms + self.config.kv_transfer_ms(len(blocks))
            heapq.heappush(self._pulls, (done_ms, next(self._transfer_seq), worker, spec, hashes, blocks))
        else:
            self.engines[worker].add_request(spec, block_hashes=hashes)
        self.router.track_add(
            request_id,
            choice.worker,
            prepared.block_hashes,
            record.input_length,
            choice.cached_blocks,
            request.output_length,
            choice.dp_rank or 0,
            session=prepared.request.session,
        )
        record.worker, record.steered_by = worker, choice.steered_by
        return worker

    def _route_split(self, record: RequestRecord, request_id: str, prepared: Prepared, pool, exact: bool) -> int:
        """A request while prefill workers may take it: prefilled on its decode worker, or on a
        prefill worker whose KV then travels to the decode worker."""
        plan = self.router.place(prepared, pool, self._answer(prepared, split=True), exact=exact)
        prompt, hashes = prepared.request.token_ids, (prepared.local_hashes, prepared.block_hashes)
        expected = prepared.request.expected_output_tokens
        decode = plan.decode.instance_id
        record.worker = decode
        if isinstance(plan, LocalPrefill):
            record.kv_source = plan.reason
            self.engines[decode].add_request(
                EngineRequestSpec(request_id, prompt, record.output_length), block_hashes=hashes
            )
            self.router.track_add(
                request_id, plan.decode, prepared.block_hashes, record.input_length, plan.overlap, expected
            )
            return decode
        record.kv_source = "remote"
        prefill_id = f"{request_id}:p"
        prefill = record.prefill_worker = plan.prefill.instance_id
        self.engines[prefill].add_request(
            EngineRequestSpec(prefill_id, prompt, 1), block_hashes=hashes, hold_on_finish=True
        )
        self.router.track_add(
            prefill_id, plan.prefill, prepared.block_hashes, record.input_length, plan.prefill_overlap, 0
        )
        # the decode worker's share of the prefill is the tail its KV transfer does not cover
        self.router.track_add(
            request_id, plan.decode, prepared.block_hashes, record.input_length, len(prepared.block_hashes), expected
        )
        self.router.picture.split_started(request_id, plan.predicted_prefill_ms, self.now_ms / 1000.0)
        self._awaiting_kv[prefill_id] = (request_id, decode, prompt, record.output_length, hashes)
        return prefill

    def _learn(self, worker: int, result: StepResult) -> None:
        """Feed a finished step to the worker's timing fit; refit its cost every few steps."""
        fit = self._fits[worker]
        capacity = self.config.num_blocks * self.config.block_size
        decoding = result.decoding_requests > 0
        counted = fit.observe(
            result.prefill_tokens, result.decode_context_tokens, capacity, decoding, result.duration_ms
        )
        if counted and fit.observations % self.config.timing_refit_steps == 0 and self.config.kv_cost == "ttft":
            # pooled with the fleet's steps, as the live router pools what its workers advertise
            step_times = self.router.chooser.step_times
            # a slow engine is of a class of its own, as a worker advertises its device (decision 62)
            speed_class = "slow" if worker < self.config.slow_workers else "normal"
            step_times.observe(REPLAY_MODEL, worker, fit.evidence(), (WorkerKey(worker, 0),), speed_class)
            step_times.refit(force=True)

    def _prefill_finished(self, prefill_id: str, prefill: int, cached_tokens: int, now: float, by_id) -> int:
        """A remote prefill ended: reserve the decode side and start the transfer (or prefill there)."""
        request_id, decode, prompt, output_length, hashes = self._awaiting_kv.pop(prefill_id)
        self.router.picture.free(prefill_id)
        by_id[request_id].cached_tokens = cached_tokens
        engine = self.engines[decode]
        plan = engine.add_remote_prefill(EngineRequestSpec(request_id, prompt, output_length), block_hashes=hashes)
        if plan is None:  # no room for the KV on the decode worker: it prefills itself
            self.engines[prefill].release_held(prefill_id)
            by_id[request_id].kv_source = "decode_memory"
            engine.add_request(EngineRequestSpec(request_id, prompt, output_length), block_hashes=hashes)
            return decode
        done_ms = now + self.config.kv_transfer_ms(plan.num_blocks)
        heapq.heappush(self._transfers, (done_ms, next(self._transfer_seq), request_id, decode, prefill))
        return decode

    def _finish_step(self, worker: int, result: StepResult, now: float, by_id: dict[str, RequestRecord]) -> list[int]:
        """Apply a finished step; returns decode workers that got a request to run at once."""
        if self._fits:
            self._learn(worker, result)
        self._publish_events(worker, now)
        host_events = self.engines[worker].drain_host_events()
        if host_events:
            first = self._next_host_event_id[worker]
            self._next_host_event_id[worker] = first + len(host_events)
            batch = tuple(KvEvent(first + i, data, HOST_TIER) for i, data in enumerate(host_events))
            self.index.publish(KvEventBatch(worker, 0, now, batch, HOST_TIER), now)
        woken = []
        for output in result.outputs:
            if output.request_id in self._awaiting_kv:
                woken.append(self._prefill_finished(output.request_id, worker, output.cached_tokens, now, by_id))
                continue
            record = by_id[output.request_id]
            if record.tokens == 0:
                record.first_token_ms = now
                if record.kv_source != "remote":
                    record.cached_tokens = output.cached_tokens
                self.router.picture.first_token(output.request_id)
            else:
                record.inter_token_ms.append(now - record.last_token_ms)
            record.tokens += 1
            record.last_token_ms = now
            if output.finish_reason is not None:
                self.router.picture.free(output.request_id, record.tokens)
                del by_id[output.request_id]
                if self._replies is not None:
                    self.replies_cached += self.engines[worker].adopt_blocks(self._replies.blocks(record.index))
                    self._publish_events(worker, now)
        return woken
