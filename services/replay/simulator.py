"""Virtual-time replay of a request trace through the real routing, indexing and engine code.

Nothing here sleeps, sockets or threads: a heap of step completions and a sorted list of arrivals
drive N :class:`MockEngine` instances, one :class:`RoutingPolicy` and one :class:`PrefixIndex`
(imported, not copied), exactly as the services would, but as fast as the CPU allows.

Timeline rules (the same as the live worker's engine loop): a step's scheduling happens when it
starts, its tokens and KV events become visible when it ends, and a worker starts its next step as
soon as the previous one ends while it has work. An arrival at the same instant as a step's end is
routed after that step's events are applied.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from services.common.hashing import sequence_hashes
from services.common.kv_events import KvEvent, KvEventBatch
from services.common.prefix_index import PrefixIndex
from services.common.timing import TimingModel
from services.replay.trace import PromptBuilder, TraceRequest
from services.router.policy import RoutingPolicy
from services.router.scheduler import make_cost_model
from services.worker.mock_engine import EngineConfig, MockEngine, StepResult


@dataclass(frozen=True)
class ReplayConfig:
    workers: int = 8
    block_size: int = 64
    num_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    router_mode: str = "kv"
    kv_cost: str = "ttft"
    overlap_score_weight: float = 1.0
    router_temperature: float = 0.0
    arrival_speedup_ratio: float = 1.0
    trace_block_size: int = 512
    seed: int = 0


@dataclass
class RequestRecord:
    """What happened to one trace request, in simulated milliseconds."""

    index: int
    arrival_ms: float
    input_length: int
    output_length: int
    worker: int = -1
    cached_tokens: int = 0
    first_token_ms: float = math.nan
    last_token_ms: float = math.nan
    tokens: int = 0
    inter_token_ms: list[float] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float:
        return self.first_token_ms - self.arrival_ms

    @property
    def e2e_ms(self) -> float:
        return self.last_token_ms - self.arrival_ms

    @property
    def tpot_ms(self) -> float:
        return (self.last_token_ms - self.first_token_ms) / (self.tokens - 1) if self.tokens > 1 else math.nan


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
        )
        self.engines = [MockEngine(engine_config) for _ in range(config.workers)]
        self.policy = RoutingPolicy(
            config.router_mode,
            config.block_size,
            config.overlap_score_weight,
            config.router_temperature,
            random.Random(config.seed),
            make_cost_model(config.kv_cost, config.block_size, config.max_num_batched_tokens, config.num_blocks),
        )
        self.index = PrefixIndex()
        self._builder = PromptBuilder(config.trace_block_size, config.block_size)
        self._next_event_id = [0] * config.workers
        self._workers = [(w, 0) for w in range(config.workers)]

    def run(self, trace: list[TraceRequest]) -> list[RequestRecord]:
        speedup = self.config.arrival_speedup_ratio
        records = [
            RequestRecord(i, r.timestamp_ms / speedup, r.input_length, r.output_length) for i, r in enumerate(trace)
        ]
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
        while next_arrival < len(trace) or completions:
            arrival_time = records[next_arrival].arrival_ms if next_arrival < len(trace) else math.inf
            if completions and completions[0][0] <= arrival_time:
                now, _, worker = heapq.heappop(completions)
                self._finish_step(worker, in_flight.pop(worker), now, by_id)
                if self.engines[worker].has_work():
                    start_step(worker, now)
                continue
            record = records[next_arrival]
            request = trace[next_arrival]
            next_arrival += 1
            worker = self._route(record, request, by_id)
            if worker not in in_flight:
                start_step(worker, record.arrival_ms)
        return records

    def _route(self, record: RequestRecord, request: TraceRequest, by_id: dict[str, RequestRecord]) -> int:
        prompt = self._builder.tokens(request)
        local = self._builder.local_hashes(request, prompt)
        block_hashes = sequence_hashes(local)
        overlaps: dict[tuple[int, int], int] = {}
        if self.policy.needs_overlaps:
            overlaps = self.index.find_matches_by_sequence(block_hashes)
        decision = self.policy.choose(
            self._workers, block_hashes, request.input_length, overlaps, self.index.tree_sizes()
        )
        request_id = f"r{record.index}"
        worker = decision.worker[0]
        self.engines[worker].add_request(request_id, prompt, request.output_length, block_hashes=(local, block_hashes))
        self.policy.active.add(request_id, decision.worker, block_hashes, request.input_length, decision.overlap_blocks)
        record.worker = worker
        by_id[request_id] = record
        return worker

    def _finish_step(self, worker: int, result: StepResult, now: float, by_id: dict[str, RequestRecord]) -> None:
        events = self.engines[worker].drain_events()
        if events:
            first = self._next_event_id[worker]
            self._next_event_id[worker] = first + len(events)
            batch = tuple(KvEvent(first + i, data) for i, data in enumerate(events))
            self.index.apply_batch(KvEventBatch(worker, 0, now, batch))
        for output in result.outputs:
            record = by_id[output.request_id]
            if record.tokens == 0:
                record.first_token_ms = now
                record.cached_tokens = output.cached_tokens
                self.policy.active.mark_prefill_completed(output.request_id)
            else:
                record.inter_token_ms.append(now - record.last_token_ms)
            record.tokens += 1
            record.last_token_ms = now
            if output.finish_reason is not None:
                self.policy.active.free(output.request_id)
                del by_id[output.request_id]
