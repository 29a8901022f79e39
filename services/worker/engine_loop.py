"""Drives the sans-I/O mock engine in real time and hands its tokens to waiting streams."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog

from kvmesh.common.runtime import cancel_and_wait
from kvmesh.worker.event_publisher import KvEventPublisher
from kvmesh.worker.mock_engine import EngineRequest, MockEngine, TokenOutput, TransferPlan

log = structlog.get_logger(__name__)


class EngineLoop:
    """Runs engine steps back to back while there is work, sleeping each step's simulated duration.

    Tokens of a step are delivered, and its KV events queued for publishing, at the end of the step,
    which is when a real engine would have produced them.
    """

    def __init__(self, engine: MockEngine, publisher: KvEventPublisher | None) -> None:
        self.engine = engine
        self._publisher = publisher
        self._streams: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        stop_token_ids: Sequence[int],
        seed: int,
        lora_name: str | None,
        hold_on_finish: bool = False,
    ) -> tuple[EngineRequest, asyncio.Queue[TokenOutput]]:
        """Queue a request; raises ``EngineRequestError`` for one the engine can never serve."""
        request = self.engine.add_request(
            request_id, prompt, max_tokens, stop_token_ids, seed, lora_name, hold_on_finish=hold_on_finish
        )
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        self._wakeup.set()
        return request, queue

    def submit_remote(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        stop_token_ids: Sequence[int],
        seed: int,
        lora_name: str | None,
    ) -> tuple[TransferPlan | None, asyncio.Queue[TokenOutput]]:
        """Reserve blocks for a prompt whose KV comes from another worker (None: no memory for it;
        nothing was queued then). Call :meth:`finish_transfer` when the transfer ends."""
        plan = self.engine.add_remote_prefill(request_id, prompt, max_tokens, stop_token_ids, seed, lora_name)
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        if plan is not None:
            self._streams[request_id] = queue
        return plan, queue

    def finish_transfer(self, request_id: str, received: bool) -> None:
        self.engine.finish_transfer(request_id, received)
        self._publish_events()
        self._wakeup.set()

    def release_held(self, request_id: str) -> None:
        if self.engine.release_held(request_id):
            self._publish_events()

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self.engine.abort(request_id):
            log.info("request aborted", request_id=request_id)
            self._publish_events()

    async def _run(self) -> None:
        while True:
            if not self.engine.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            result = self.engine.step()
            if result.duration_ms > 0:
                await asyncio.sleep(result.duration_ms / 1000.0)
            self._publish_events()
            for output in result.outputs:
                queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
                if output.finish_reason is not None:
                    self._streams.pop(output.request_id, None)

    def dump_state(self) -> tuple[int, list[tuple[int, int, int | None]]]:
        """(last event id, cached blocks) as one consistent picture.

        Events the current step produced are numbered first, so the dump reflects exactly the
        events up to the returned id; runs without awaiting, so no step can interleave.
        """
        self._publish_events()
        last = self._publisher.last_event_id if self._publisher is not None else -1
        return last, self.engine.blocks.cached_blocks()

    def _publish_events(self) -> None:
        events = self.engine.drain_events()
        if events and self._publisher is not None:
            self._publisher.enqueue(events)
