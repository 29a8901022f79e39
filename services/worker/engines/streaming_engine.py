"""What an engine that runs elsewhere shares, whether in-process vLLM's ``AsyncLLM`` or an engine
server behind HTTP (:mod:`~kvmesh.worker.engines.vllm.vllm_engine`,
:mod:`~kvmesh.worker.engines.served.served_engine`): each request is an asyncio task streaming the
engine's outputs into its queue, the engine's cache is what its KV events (translated by a
:class:`~kvmesh.worker.engines.vllm.vllm_events.VllmEventTranslator`) say, and its KV never moves
through the worker's own transfer server.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from kvmesh.worker.engine import (
    CachedBlock,
    Engine,
    EngineRequestError,
    EngineRequestSpec,
    EngineStatus,
    TokenQueue,
    TransferPlan,
)
from kvmesh.worker.engines.vllm.vllm_events import VllmEventTranslator

log = structlog.get_logger(__name__)


class StreamingEngine(Engine, abc.ABC):
    """Guarantees beyond :class:`Engine`'s: a request aborted by its caller has its task cancelled
    (which ends it at the engine); :meth:`dump_kv_state` is the translator's view, consistent with
    the events numbered up to the id it returns (the relay runs on this event loop)."""

    # why the worker's transfer server hooks refuse (the subclass says how its KV moves, if at all)
    no_transfer_reason = "this engine's KV does not move through the worker's transfer server"

    def __init__(self, last_event_id: Callable[[], int]) -> None:
        """``last_event_id``: the id of the last KV event the worker's publisher numbered."""
        self._last_event_id = last_event_id
        self._translator = VllmEventTranslator()
        self._requests: dict[str, asyncio.Task[None]] = {}
        self.block_size = 0
        self.num_blocks = 0
        self.max_model_len = 0  # 0: not known, not checked

    def _run(self, spec: EngineRequestSpec, stream: Callable[[TokenQueue], Coroutine[Any, Any, None]]) -> TokenQueue:
        """Start ``stream(queue)`` as the request's task, after the checks every engine makes;
        raises :class:`EngineRequestError` for a request it can never serve."""
        if spec.request_id in self._requests:
            raise EngineRequestError(f"request {spec.request_id!r} is already in the engine")
        if not spec.prompt:
            raise EngineRequestError("the prompt is empty")
        if self.max_model_len and len(spec.prompt) + spec.max_tokens > self.max_model_len:
            raise EngineRequestError(
                f"the prompt ({len(spec.prompt)} tokens) plus max_tokens ({spec.max_tokens}) is longer than "
                f"the model's context of {self.max_model_len} tokens"
            )
        queue = TokenQueue()
        task = asyncio.create_task(stream(queue), name=f"{type(self).__name__}-{spec.request_id}")
        self._requests[spec.request_id] = task
        task.add_done_callback(lambda _t: self._requests.pop(spec.request_id, None))
        return queue

    def abort(self, request_id: str) -> None:
        task = self._requests.pop(request_id, None)
        if task is not None and not task.done():
            task.cancel()
            log.info("request aborted", request_id=request_id)

    async def _end_requests(self) -> None:
        """Cancel every request's task and wait for each to end (at stop)."""
        tasks = list(self._requests.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---- the worker's own transfer server's hooks ----------------------------------------------
    def reserve_remote(self, spec: EngineRequestSpec) -> tuple[TransferPlan | None, TokenQueue]:
        raise EngineRequestError(self.no_transfer_reason)

    def finish_transfer(self, request_id: str, received: bool) -> None:
        raise EngineRequestError(self.no_transfer_reason)

    def held_slots(self, request_id: str, num_blocks: int) -> list[int]:
        raise EngineRequestError(self.no_transfer_reason)

    def release_held(self, request_id: str) -> None:
        return None  # the engine frees its blocks itself

    # ---- state -------------------------------------------------------------------------------
    def status(self) -> EngineStatus:
        return EngineStatus(
            block_size=self.block_size,
            total_blocks=self.num_blocks,
            cached_blocks=len(self._translator),
            active_blocks=0,  # not reported per request; the engine's own metrics have the usage
            running_requests=len(self._requests),
            waiting_requests=0,
            held_prefills=0,
        )

    def dump_kv_state(self) -> tuple[int, list[CachedBlock]]:
        return self._last_event_id(), self._translator.cached_blocks()
