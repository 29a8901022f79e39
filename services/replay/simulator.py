"""Virtual-time replay of a request trace through the real routing, indexing and engine code.

Nothing here sleeps, sockets or threads: a heap of step completions and a sorted list of arrivals
drive N :class:`MockEngine` instances, one :class:`RoutingPolicy` and one :class:`PrefixIndex`
(imported, not copied), exactly as the services would, but as fast as the CPU allows.

With ``prefill_workers`` the replay disaggregates as the router does (``place_prefill``, the same
function): a remote prefill runs on a prefill engine with ``max_tokens = 1`` and holds its blocks;
when it ends, the decode engine reserves blocks for the prompt, the KV transfer takes
``blocks × block_size × kv_bytes_per_token / kv_transfer_gbps``, then the decode engine runs the
request from there and the prefill engine releases its blocks.

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

from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.core.tier_credits import credited_matches, offloaded_blocks
from kvmesh.common.core.timing import TimingModel, scaled
from kvmesh.common.core.timing_fit import TimingFit
from kvmesh.common.wire.hashing import sequence_hashes, token_bytes
from kvmesh.common.wire.kv_events import HOST_DP_RANK, HOST_TIER, PSEUDO_DP_RANKS, KvEvent, KvEventBatch
from kvmesh.planner.load import IntervalObservation
from kvmesh.planner.planner import POOLS, Decision, Planner, PoolSizes
from kvmesh.replay.arrival_profile import parse_arrival_profile
from kvmesh.replay.config import ReplayConfig, RequestRecord, parse_mix
from kvmesh.replay.fleet import IntervalRecorder, VirtualFleet
from kvmesh.replay.mooncake_trace import PromptBuilder, TraceRequest
from kvmesh.router.eligibility import BusyThresholds
from kvmesh.router.load_tracker import LoadTracker
from kvmesh.router.policy import RoutingPolicy
from kvmesh.router.predicted_blocks import PredictedBlocks
from kvmesh.router.prefill_placement import place_prefill
from kvmesh.router.request_queue import Waiting, WaitingRequests
from kvmesh.router.scheduler import PerWorkerTtftCost, make_cost_model
from kvmesh.worker.engine import EngineRequestSpec
from kvmesh.worker.mock_engine import EngineConfig, MockEngine, StepResult


class ReplaySimulator:
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
        # the router's own load tracking, in virtual time
        self.loads = LoadTracker(config.track_active_blocks, config.router_track_output_blocks)
        prior = scaled(TimingModel(), config.router_prefill_scale, config.router_decode_scale)
        rng = random.Random(config.seed)
        cost_model = make_cost_model(
            config.kv_cost, config.block_size, config.max_num_batched_tokens, config.num_blocks, prior
        )

        def policy(mode: str) -> RoutingPolicy:
            return RoutingPolicy(
                mode,
                config.block_size,
                config.kv_overlap_score_weight,
                config.router_temperature,
                rng,
                cost_model,
                active=self.loads.sequences(config.block_size),
                cache_aware=config.cache_aware_options(),
                moe_score_weight=config.moe_score_weight,
            )

        self.policy = policy(config.router_mode)
        # with prefill workers: SGLang-style PD pairing, a mode per pool (default: the router's)
        self.decode_policy = policy(config.decode_policy) if config.decode_policy else self.policy
        self.prefill_policy = policy(config.prefill_policy) if config.prefill_policy else self.policy
        self.index = PrefixIndex()
        # KV events on their way to the index (--kv-event-delay-ms): (visible at, seq, batch)
        self._events_in_flight: list[tuple[float, int, KvEventBatch]] = []
        # the router queue (--active-*-threshold, --router-queue-*), as the live router keeps it
        self.thresholds = BusyThresholds(config.active_decode_blocks_threshold, config.active_prefill_tokens_threshold)
        queue_config = config.queue_config()
        self.queue = WaitingRequests(queue_config) if queue_config.size > 0 else None
        self._queue_order = itertools.count()
        # predict-on-route (--router-predicted-ttl-secs), as the live router keeps it
        ttl = config.router_predicted_ttl_secs
        self.predicted = PredictedBlocks(ttl) if ttl > 0 else None
        self._fits = [TimingFit(prior) for _ in range(total)] if config.router_timing == "learned" else []
        if config.router_timing == "exact" and isinstance(self.policy.cost_model, PerWorkerTtftCost):
            for w, engine in enumerate(self.engines):
                self.policy.cost_model.set_timing((w, 0), engine.config.timing)
        self._builder = PromptBuilder(config.trace_block_size, config.block_size)
        self._next_event_id = [0] * total
        self._next_host_event_id = [0] * total  # each worker's host tier numbers its own events
        self._workers = [(w, 0) for w in range(config.workers)]
        self._prefill_workers = [(w, 0) for w in range(config.workers, total)]
        # prefill request id -> (request id, decode worker, prompt, output length, (local, sequence) hashes)
        self._awaiting_kv: dict[str, tuple[str, int, list[int], int, tuple[list[int], list[int]]]] = {}
        self._transfers: list[tuple[float, int, str, int, int]] = []  # (done at, seq, request id, decode, prefill)
        self._transfer_seq = itertools.count()
        # with --planner: the fleet it scales, its decisions, and the events it schedules
        self.planner: Planner | None = None
        self.fleet: VirtualFleet | None = None
        self.decisions: list[Decision] = []
        self.steps: list[tuple[IntervalObservation, Decision]] = []
        self._timers: list[tuple[float, int, str, int]] = []  # (at, seq, "tick" | "join", worker)

    def attach_planner(self, planner: Planner) -> None:
        """Let ``planner`` size the fleet during :meth:`run` (the virtual connector): the aggregated
        pool, or with ``--prefill-workers`` the prefill and decode pools."""
        if planner.disaggregated != bool(self._prefill_workers):
            raise ValueError("a disaggregated replay (--prefill-workers) needs a disaggregated planner, and only it")
        self.planner = planner
        self.fleet = VirtualFleet(self.config.worker_startup_secs * 1000.0)
        for worker in range(len(self.engines)):
            self.fleet.start(worker, self._pool_of(worker), 0.0, immediately=True)

    def _pool_of(self, worker: int) -> str:
        if not self._prefill_workers:
            return "aggregated"
        return "prefill" if (worker, 0) in self._prefill_workers else "decode"

    def _routable(self, pool: str) -> list[tuple[int, int]]:
        """The router's list of workers in ``pool`` (what it may send requests to)."""
        return self._prefill_workers if pool == "prefill" else self._workers

    def run(self, trace: list[TraceRequest]) -> list[RequestRecord]:
        speedup = self.config.arrival_speedup_ratio
        profile = parse_arrival_profile(self.config.arrival_profile)
        records = [
            RequestRecord(
                i,
                profile.warp_ms(r.timestamp_ms / speedup) if profile else r.timestamp_ms / speedup,
                r.input_length,
                r.output_length,
            )
            for i, r in enumerate(trace)
        ]
        if self.config.priority_mix:
            mix = parse_mix(self.config.priority_mix)
            draw = random.Random(self.config.seed)
            for record in records:
                record.priority = draw.choices(list(mix), weights=list(mix.values()))[0]
        self.records = records
        if self.planner is not None:
            self._schedule("tick", self.config.adjustment_interval * 1000.0)
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
        while next_arrival < len(trace) or completions or self._transfers:
            arrival_time = records[next_arrival].arrival_ms if next_arrival < len(trace) else math.inf
            transfer_time = self._transfers[0][0] if self._transfers else math.inf
            timer_time = self._timers[0][0] if self._timers else math.inf
            if timer_time <= min(arrival_time, transfer_time) and (not completions or timer_time < completions[0][0]):
                now, _, kind, worker = heapq.heappop(self._timers)
                self._on_timer(kind, worker, now, next_arrival < len(trace) or bool(completions))
                continue
            if transfer_time <= arrival_time and (not completions or transfer_time < completions[0][0]):
                now, _, request_id, decode, prefill = heapq.heappop(self._transfers)
                self.engines[prefill].release_held(f"{request_id}:p")
                self.engines[decode].finish_transfer(request_id, True)
                if decode not in in_flight:
                    start_step(decode, now)
                continue
            if completions and completions[0][0] <= arrival_time:
                now, _, worker = heapq.heappop(completions)
                for decode in self._finish_step(worker, in_flight.pop(worker), now, by_id):
                    if decode not in in_flight and self.engines[decode].has_work():
                        start_step(decode, now)
                if worker not in in_flight and self.engines[worker].has_work():
                    start_step(worker, now)
                elif worker not in in_flight:
                    self._stop_if_drained(worker, now)
                # capacity freed: waiting requests get their turn
                for routed in self._dispatch(now, trace, by_id):
                    if routed not in in_flight:
                        start_step(routed, now)
                continue
            record = records[next_arrival]
            request = trace[next_arrival]
            next_arrival += 1
            if not self._admit_now(record, request):
                continue  # waits in the router queue, or was refused
            worker = self._route(record, request, by_id)
            if worker not in in_flight:
                start_step(worker, record.arrival_ms)
        if self.queue is not None and len(self.queue):
            raise RuntimeError(f"{len(self.queue)} requests were left in the router queue")
        return records

    # ---- the router queue -------------------------------------------------------------------
    def _all_busy(self) -> bool:
        """Every worker the router may send a whole request to is over a busy threshold."""
        if self.thresholds.active_decode_blocks is None and self.thresholds.active_prefill_tokens is None:
            return False
        active = self.loads.sequences(self.config.block_size)
        return all(self.thresholds.exceeded(*active.load(worker)) for worker in self._workers)

    def _admit_now(self, record: RequestRecord, request: TraceRequest) -> bool:
        """Whether an arriving request routes at once; else it waits (or is refused, queue full),
        behind any already waiting, as the live router's queue does."""
        if self.queue is None or (not len(self.queue) and not self._all_busy()):
            if self.queue is None and self._all_busy():
                record.refused = "busy"  # no queue: refused at once
                return False
            return True
        self._expire_waiting(record.arrival_ms)
        if len(self.queue.waiting[record.priority]) >= self.queue.config.size:
            record.refused = "full"
            return False
        # shortest-prefill-first's key: the prompt past the longest cached prefix the index knows
        prompt = self._builder.tokens(request)
        matches = self.index.find_matches_by_sequence(sequence_hashes(self._builder.local_hashes(request, prompt)))
        uncached = max(0, record.input_length - max(matches.values(), default=0) * self.config.block_size)
        self.queue.add(Waiting(next(self._queue_order), record.priority, uncached, record.arrival_ms, payload=record))
        return False

    def _expire_waiting(self, now: float) -> None:
        assert self.queue is not None
        deadline = self.queue.config.timeout_s * 1000.0
        for waiting in list(self.queue.waiting.values()):
            for entry in list(waiting):
                if now - entry.enqueued_at >= deadline:
                    self.queue.remove(entry)
                    record = entry.payload
                    assert isinstance(record, RequestRecord)
                    record.refused, record.queued_ms = "timeout", now - entry.enqueued_at

    def _dispatch(self, now: float, trace: list[TraceRequest], by_id: dict[str, RequestRecord]) -> list[int]:
        """Route waiting requests, in the queue's order, while a worker can take one; the workers
        that got one."""
        if self.queue is None or not len(self.queue):
            return []
        self._expire_waiting(now)
        routed = []
        while len(self.queue) and not self._all_busy():
            entry = self.queue.next()
            assert entry is not None
            self.queue.remove(entry)
            self.queue.charge(entry)
            record = entry.payload
            assert isinstance(record, RequestRecord)
            record.queued_ms = now - entry.enqueued_at
            routed.append(self._route(record, trace[record.index], by_id, now))
        return routed

    # ---- the planner and its virtual fleet ----------------------------------------------------------
    def _schedule(self, kind: str, at_ms: float, worker: int = -1) -> None:
        heapq.heappush(self._timers, (at_ms, next(self._transfer_seq), kind, worker))

    def _on_timer(self, kind: str, worker: int, now: float, busy: bool) -> None:
        assert self.planner is not None and self.fleet is not None
        if kind == "join":
            joined = self.fleet.workers[worker]
            if joined.draining_since_ms is None:
                self._routable(joined.role).append((worker, 0))
            return
        interval_ms = self.config.adjustment_interval * 1000.0
        current = PoolSizes(*(len(self.fleet.live(pool)) for pool in POOLS))
        recorder = IntervalRecorder(self.config.ttft_target_ms, self.config.itl_target_ms)
        observation = recorder.observe(self.records, now - interval_ms, now, current.total, self.loads.worker_loads())
        decision = self.planner.step(observation, current)
        self.decisions.append(decision)
        self.steps.append((observation, decision))
        point = {
            "t_s": now / 1000.0,
            "workers": current.total,
            "target": decision.target.total,
            "observed_rate": observation.request_rate,
            "predicted_rate": decision.forecast.request_rate,
        }
        if self.planner.disaggregated:
            point |= {"prefill": current.prefill, "decode": current.decode}
            point |= {"prefill_target": decision.target.prefill, "decode_target": decision.target.decode}
        self.fleet.timeline.append(point)
        for pool in POOLS:
            change = getattr(decision.target, pool) - getattr(current, pool)
            for _ in range(max(change, 0)):
                self._add_worker(pool, now)
            for drained in self.fleet.drain(max(-change, 0), pool, now):
                if (drained.index, 0) in self._routable(pool):
                    self._routable(pool).remove((drained.index, 0))
                self._stop_if_drained(drained.index, now)
        if busy:
            self._schedule("tick", now + interval_ms)

    def _add_worker(self, pool: str, now: float) -> None:
        assert self.fleet is not None
        index = len(self.engines)
        self.engines.append(MockEngine(self.engine_config))
        self._next_event_id.append(0)
        if self._fits:
            self._fits.append(TimingFit(self._fits[0].prior))
        if self.config.router_timing == "exact" and isinstance(self.policy.cost_model, PerWorkerTtftCost):
            self.policy.cost_model.set_timing((index, 0), self.engine_config.timing)
        worker = self.fleet.start(index, pool, now)
        self._schedule("join", worker.joins_ms, index)

    def _oracle_matches(self, block_hashes: list[int]) -> dict[tuple[int, int], int]:
        """Per routable worker, the leading blocks it holds or is computing now (--oracle-index)."""
        matches = {}
        for key in self._routable("decode") + self._routable("prefill"):
            engine = self.engines[key[0]]
            held = engine.blocks.cached_prefix_length(block_hashes)
            if held < len(block_hashes) and engine.num_requests:
                computing: set[int] = set()
                for request in (*engine.waiting, *engine.running, *engine.transferring.values()):
                    computing.update(request.seq_hashes)
                while held < len(block_hashes) and (
                    block_hashes[held] in computing or engine.blocks.slot_of(block_hashes[held]) is not None
                ):
                    held += 1
            if held:
                matches[key] = held
        return matches

    def _publish(self, batch: KvEventBatch, now: float) -> None:
        """Into the index at once, or once it has travelled (--kv-event-delay-ms; applied before the
        next routing after)."""
        delay = self.config.kv_event_delay_ms
        if delay > 0:
            heapq.heappush(self._events_in_flight, (now + delay, next(self._transfer_seq), batch))
        else:
            self.index.apply_batch(batch)

    def _deliver_events(self, now: float) -> None:
        """Apply the KV events that have reached the index by ``now`` (ms), in the order they left."""
        while self._events_in_flight and self._events_in_flight[0][0] <= now:
            _, _, batch = heapq.heappop(self._events_in_flight)
            self.index.apply_batch(batch)

    def _stop_if_drained(self, worker: int, now: float) -> None:
        if self.fleet is None or worker >= len(self.fleet.workers):
            return
        state = self.fleet.workers[worker]
        if state.draining_since_ms is not None and state.stopped_ms is None and not self.engines[worker].has_work():
            state.stopped_ms = now
            # its events still on their way would bring its blocks back after it is gone
            self._events_in_flight = [e for e in self._events_in_flight if e[2].worker_id != worker]
            heapq.heapify(self._events_in_flight)
            self.index.remove_worker(worker)
            if self.predicted is not None:
                self.predicted.remove_worker(worker)
            self.loads.remove_worker(worker)

    def _route(
        self, record: RequestRecord, request: TraceRequest, by_id: dict[str, RequestRecord], at_ms: float | None = None
    ) -> int:
        """Route ``record`` at ``at_ms`` (its arrival, or when the router queue let it go)."""
        at_ms = record.arrival_ms if at_ms is None else at_ms
        prompt = self._builder.tokens(request)
        local = self._builder.local_hashes(request, prompt)
        block_hashes = sequence_hashes(local)
        policies = (self.decode_policy, self.prefill_policy) if self._prefill_workers else (self.policy,)
        overlaps: dict[tuple[int, int], int] = {}
        now_s = at_ms / 1000.0
        needs_overlaps = any(policy.needs_overlaps for policy in policies)
        if needs_overlaps and self.config.oracle_index:
            overlaps = self._oracle_matches(block_hashes)
        elif needs_overlaps:
            self._deliver_events(at_ms)
            overlaps = self.index.find_matches_by_sequence(block_hashes)
            if self.config.host_kv_blocks:  # host tiers are indexed apart: credited as the router does
                host, disk = offloaded_blocks(overlaps)
                device = {key: blocks for key, blocks in overlaps.items() if key[1] not in PSEUDO_DP_RANKS}
                overlaps = credited_matches(device, self.config.tier_credits(), pooled={}, host=host, disk=disk)
            if self.predicted is not None and not self.config.oracle_index:
                for key, blocks in self.predicted.matches(block_hashes, now_s).items():
                    overlaps[key] = max(overlaps.get(key, 0), blocks)
        tokens = token_bytes(prompt) if any(policy.needs_tokens for policy in policies) else None
        request_id = f"r{record.index}"
        by_id[request_id] = record
        if self._prefill_workers:
            routed = self._route_disaggregated(
                record, request_id, prompt, (local, block_hashes), overlaps, tokens, at_ms
            )
            if needs_overlaps and self.predicted is not None and not self.config.oracle_index:
                for worker in {routed, record.worker}:
                    self.predicted.record((worker, 0), block_hashes, now_s)
            return routed
        decision = self.policy.choose(
            self._workers,
            block_hashes,
            request.input_length,
            overlaps,
            self.index.tree_sizes(),
            tokens=tokens,
            now=now_s,
        )
        worker = decision.worker[0]
        if needs_overlaps and self.predicted is not None and not self.config.oracle_index:
            self.predicted.record(decision.worker, block_hashes, now_s)
        self.engines[worker].add_request(
            EngineRequestSpec(request_id, prompt, request.output_length), block_hashes=(local, block_hashes)
        )
        self._track(request_id, decision.worker, block_hashes, request.input_length, decision.overlap_blocks, at_ms)
        record.worker = worker
        return worker

    def _route_disaggregated(
        self,
        record: RequestRecord,
        request_id: str,
        prompt: list[int],
        hashes: tuple[list[int], list[int]],
        overlaps: dict[tuple[int, int], int],
        tokens: bytes | None,
        at_ms: float,
    ) -> int:
        config = self.config
        block_hashes = hashes[1]
        placement = place_prefill(
            self.decode_policy,
            self._workers,
            self._prefill_workers,
            block_hashes,
            record.input_length,
            overlaps,
            self.index.tree_sizes(),
            min_uncached_tokens=config.disagg_min_uncached_tokens,
            prefill_queue_limit_tokens=config.prefill_queue_limit_tokens,
            prefill_policy=self.prefill_policy,
            tokens=tokens,
            now=at_ms / 1000.0,
        )
        decode = placement.decode[0]
        record.worker = decode
        if placement.prefill is None:
            record.kv_source = placement.reason
            self.engines[decode].add_request(
                EngineRequestSpec(request_id, prompt, record.output_length), block_hashes=hashes
            )
            self._track(request_id, placement.decode, block_hashes, record.input_length, placement.overlap, at_ms)
            return decode
        record.kv_source = "remote"
        prefill_id = f"{request_id}:p"
        prefill = placement.prefill[0]
        self.engines[prefill].add_request(
            EngineRequestSpec(prefill_id, prompt, 1), block_hashes=hashes, hold_on_finish=True
        )
        self._track(prefill_id, placement.prefill, block_hashes, record.input_length, placement.overlap, at_ms)
        # the decode worker's share of the prefill is the tail its KV transfer does not cover
        self._track(request_id, placement.decode, block_hashes, record.input_length, len(block_hashes), at_ms)
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
        cost = self.policy.cost_model
        if counted and fit.observations % self.config.timing_refit_steps == 0 and isinstance(cost, PerWorkerTtftCost):
            cost.set_timing((worker, 0), fit.model())

    def _track(
        self,
        request_id: str,
        worker: tuple[int, int],
        block_hashes: list[int],
        prompt_tokens: int,
        overlap: int,
        at_ms: float,
    ) -> None:
        """Record a routed request in the router's load picture, at the time it was routed."""
        self.loads.add(request_id, worker, self.config.block_size, block_hashes, prompt_tokens, overlap, 0, at_ms)

    def _prefill_finished(self, prefill_id: str, prefill: int, cached_tokens: int, now: float, by_id) -> int:
        """A remote prefill ended: reserve the decode side and start the transfer (or prefill there)."""
        request_id, decode, prompt, output_length, hashes = self._awaiting_kv.pop(prefill_id)
        self.loads.free(prefill_id)
        by_id[request_id].cached_tokens = cached_tokens
        engine = self.engines[decode]
        plan = engine.add_remote_prefill(EngineRequestSpec(request_id, prompt, output_length), block_hashes=hashes)
        if plan is None:  # no room for the KV on the decode worker: it prefills itself
            self.engines[prefill].release_held(prefill_id)
            by_id[request_id].kv_source = "decode_memory"
            engine.add_request(EngineRequestSpec(request_id, prompt, output_length), block_hashes=hashes)
            return decode
        bytes_moved = plan.num_blocks * self.config.block_size * self.config.kv_bytes_per_token
        transfer_ms = bytes_moved / (self.config.kv_transfer_gbps * 1e6)
        heapq.heappush(self._transfers, (now + transfer_ms, next(self._transfer_seq), request_id, decode, prefill))
        return decode

    def _finish_step(self, worker: int, result: StepResult, now: float, by_id: dict[str, RequestRecord]) -> list[int]:
        """Apply a finished step; returns decode workers that got a request to run at once."""
        if self._fits:
            self._learn(worker, result)
        events = self.engines[worker].drain_events()
        if events:
            first = self._next_event_id[worker]
            self._next_event_id[worker] = first + len(events)
            batch = tuple(KvEvent(first + i, data) for i, data in enumerate(events))
            self._publish(KvEventBatch(worker, 0, now, batch), now)
        host_events = self.engines[worker].drain_host_events()
        if host_events:
            first = self._next_host_event_id[worker]
            self._next_host_event_id[worker] = first + len(host_events)
            batch = tuple(KvEvent(first + i, data, HOST_TIER) for i, data in enumerate(host_events))
            self._publish(KvEventBatch(worker, HOST_DP_RANK, now, batch), now)
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
                self.loads.first_token(output.request_id)
            else:
                record.inter_token_ms.append(now - record.last_token_ms)
            record.tokens += 1
            record.last_token_ms = now
            if output.finish_reason is not None:
                self.loads.free(output.request_id)
                del by_id[output.request_id]
        return woken
