"""The mock engine as an :class:`Engine`: drives the sans-I/O scheduler in real time and hands its
tokens to waiting streams."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import structlog

from kvmesh.common.core.timing import TimingModel, real_time
from kvmesh.common.core.timing_fit import TimingEvidence, TimingFit
from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.wire.kv_events import HOST_TIER
from kvmesh.worker.engine import (
    CachedBlock,
    Engine,
    EngineRequestError,
    EngineRequestSpec,
    EngineStatus,
    TokenQueue,
    TransferPlan,
)
from kvmesh.worker.engines.mock.mock_engine import MockEngine, StepResult
from kvmesh.worker.event_publisher import KvEventPublisher
from kvmesh.worker.kv_transfer.kv_pool import KvPool
from kvmesh.worker.kv_transfer.pool_writer import PoolWriter

log = structlog.get_logger(__name__)


@dataclass
class PoolStats:
    """What this worker moved through the KV pool."""

    imported_blocks: int = 0
    rejected_blocks: int = 0  # read from the pool but not what this worker would compute


# How far behind their schedule the steps may catch up: half the event loop's timer resolution (a
# millisecond), the most one rounded wait overshoots (see ``MockEngineLoop._run``).
SCHEDULE_SLACK_S = 0.0005


class MockEngineLoop(Engine):
    """Runs engine steps back to back while there is work, sleeping each step's simulated duration.

    Tokens of a step are delivered, and its KV events queued for publishing, at the end of the step,
    which is when a real engine would have produced them.
    """

    def __init__(
        self,
        engine: MockEngine,
        publisher: KvEventPublisher | None,
        pool: KvPool | None = None,
        pool_publisher: KvEventPublisher | None = None,
        host_publisher: KvEventPublisher | None = None,
    ) -> None:
        """``pool``: the host's KV pool, written through with every block this engine computes (its
        changes published by ``pool_publisher``) and read for a new request's uncached blocks;
        ``host_publisher``: publishes the engine's host tier (a stream of tier ``host``)."""
        self._host_publisher = host_publisher
        self.engine = engine
        self.pool = pool
        self.pool_writer = PoolWriter(pool, pool_publisher) if pool is not None else None
        self.pool_stats = PoolStats()
        # what the steps really took (sleep overshoot and event-loop load included), not the model
        self.timing_fit = TimingFit(real_time(engine.config.timing))
        self.speed_class = f"mock x{engine.config.timing.speedup_ratio:g}"  # its steps' speed, whatever the host
        self.block_size = engine.block_size
        self.max_num_batched_tokens = engine.config.max_num_batched_tokens
        self._publisher = publisher
        self._streams: dict[str, TokenQueue] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def submit(
        self, spec: EngineRequestSpec, hold_on_finish: bool = False, kv_transfer_params: dict[str, Any] | None = None
    ) -> TokenQueue:
        if kv_transfer_params:
            raise EngineRequestError("the mock engine moves KV through the worker's transfer server, not a connector")
        hashes = self._import_from_pool(spec) if self.pool is not None else None
        self.engine.add_request(spec, hold_on_finish=hold_on_finish, block_hashes=hashes)
        queue = TokenQueue()
        self._streams[spec.request_id] = queue
        self._wakeup.set()
        return queue

    def reserve_remote(self, spec: EngineRequestSpec) -> tuple[TransferPlan | None, TokenQueue]:
        plan = self.engine.add_remote_prefill(spec)
        queue = TokenQueue()
        if plan is not None:
            self._streams[spec.request_id] = queue
        return plan, queue

    def finish_transfer(self, request_id: str, received: bool) -> None:
        self.engine.finish_transfer(request_id, received)
        self._publish_events()
        self._wakeup.set()

    def held_slots(self, request_id: str, num_blocks: int) -> list[int]:
        return self.engine.held_slots(request_id, num_blocks)

    def release_held(self, request_id: str) -> None:
        if self.engine.release_held(request_id):
            self._publish_events()

    moves_blocks = True

    def hot_blocks(self, limit: int) -> list[tuple[int, int, int | None]]:
        return self.engine.hot_blocks(limit)

    def cached_prefix(self, sequence_hashes: list[int]) -> list[tuple[int, int, int | None]]:
        return self.engine.cached_prefix(sequence_hashes)

    def offer_blocks(self, offer_id: str, sequence_hashes: list[int]) -> list[tuple[int, int]]:
        return self.engine.offer_blocks(offer_id, sequence_hashes)

    def reserve_intake(self, intake_id: str, blocks: list[tuple[int, int, int | None]]) -> list[int]:
        slots = self.engine.reserve_intake(intake_id, blocks)
        self._publish_events()  # making room may have evicted blocks
        return slots

    def finish_intake(self, intake_id: str, received: bool) -> int:
        taken = self.engine.finish_intake(intake_id, received)
        self._publish_events()
        return taken

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self.engine.abort(request_id):
            log.info("request aborted", request_id=request_id)
            self._publish_events()

    def status(self) -> EngineStatus:
        engine = self.engine
        return EngineStatus(
            block_size=engine.block_size,
            total_blocks=engine.config.num_blocks,
            cached_blocks=engine.cache.num_cached,
            active_blocks=engine.cache.num_active,
            running_requests=len(engine.running),
            waiting_requests=len(engine.waiting),
            held_prefills=len(engine.held),
        )

    def dump_kv_state(self) -> tuple[int, list[CachedBlock]]:
        """Events the current step produced are numbered first, so the dump reflects exactly the
        events up to the returned id; runs without awaiting, so no step can interleave."""
        self._publish_events()
        last = self._publisher.last_event_id if self._publisher is not None else -1
        # the mock engine's block id is our sequence hash
        blocks = [CachedBlock(h, local, parent, h) for h, local, parent in self.engine.cache.cached_blocks()]
        return last, blocks

    def dump_tier_state(self, tier: str) -> tuple[int, list[CachedBlock]] | None:
        """The host tier's blocks and the last event id its publisher numbered; None without one
        (the mock engine has no disk tier)."""
        host = self.engine.cache.host
        if tier != HOST_TIER or host is None or self._host_publisher is None:
            return None
        self._publish_events()
        return self._host_publisher.last_event_id, [
            CachedBlock(h, local, parent, h) for h, local, parent in host.blocks()
        ]

    def dump_pool_state(self) -> tuple[int, list[CachedBlock]] | None:
        if self.pool_writer is None:
            return None
        self._publish_events()
        return self.pool_writer.dump()

    async def _run(self) -> None:
        # When the current step's simulated end falls due. The event loop's timers run to the nearest
        # millisecond, so a step shorter than half of one would not wait at all and the engine would
        # run ahead of its timing model (at --speedup-ratio 100 a decode step is modelled at about
        # 0.07 ms). Each step waits for its end on a running schedule instead, so the rounding of one
        # wait is made up by the next ones and the steps keep the model's pace on average.
        due = 0.0
        while True:
            if not self.engine.has_work():
                if self.pool_writer is not None and self.pool_writer.in_flight:
                    self._publish_events()  # idle: nothing to overlap the copies in flight with
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            started = time.perf_counter()
            result = self.engine.step()
            if result.duration_ms > 0:
                # A step starts when the one before it ends, or now if that end is past: at most
                # SCHEDULE_SLACK_S before now, so a wait that the timer rounded up is made up by the
                # next steps, and the time spent idle is not.
                due = max(due, started - SCHEDULE_SLACK_S) + result.duration_ms / 1000.0
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            self._observe(result, (time.perf_counter() - started) * 1000.0)
            self._publish_events()
            for output in result.outputs:
                queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
                if output.finish_reason is not None:
                    self._streams.pop(output.request_id, None)

    def fitted_timing(self) -> TimingModel | None:
        return self.timing_fit.model() if self.timing_fit.observations else None

    def timing_evidence(self) -> TimingEvidence | None:
        return self.timing_fit.evidence() if self.timing_fit.observations else None

    def _observe(self, result: StepResult, measured_ms: float) -> None:
        decoding = result.decoding_requests > 0
        capacity = self.engine.capacity_tokens
        self.timing_fit.observe(result.prefill_tokens, result.decode_context_tokens, capacity, decoding, measured_ms)

    def _import_from_pool(self, spec: EngineRequestSpec) -> tuple[list[int], list[int]]:
        """Bring the prompt's blocks that this cache lacks and the pool holds into the cache, so the
        request prefills only what neither has (a migrated request resumes this way). Returns the
        prompt's (local, sequence) block hashes, computed once for the engine too."""
        cache = self.engine.cache
        local, chained = cache.prompt_hashes(spec.prompt, spec.lora_name)
        usable = (len(spec.prompt) - 1) // self.block_size  # the last prompt token is always computed
        cached = cache.blocks.cached_prefix_length(chained[:usable])
        assert self.pool is not None
        contents = self.pool.read_prefix(chained[cached:usable])
        if not contents:
            return local, chained
        started = time.perf_counter()
        taken = cache.import_blocks(
            chained[cached : cached + len(contents)],
            local[cached : cached + len(contents)],
            chained[:cached],
            contents,
        )
        self.pool_stats.imported_blocks += taken
        self.pool_stats.rejected_blocks += len(contents) - taken
        log.info(
            "KV blocks imported from the pool",
            request_id=spec.request_id,
            blocks=taken,
            cached_before=cached,
            ms=round((time.perf_counter() - started) * 1000, 3),
        )
        return local, chained

    def _publish_events(self) -> None:
        """Queue the events of what the engine did; with a pool, the copies into it that were in
        flight during this step become readable and the blocks it stored start theirs."""
        events = self.engine.drain_events()
        if self.pool_writer is not None:
            self.pool_writer.commit()
            if events:
                self.pool_writer.write(events, self.engine.cache)
        if events and self._publisher is not None:
            self._publisher.enqueue(events)
        if self._host_publisher is not None:
            host_events = self.engine.drain_host_events()
            if host_events:
                self._host_publisher.enqueue(host_events)
