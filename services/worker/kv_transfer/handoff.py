"""A worker's half of prefill/decode disaggregation, over any :class:`Engine`.

On a prefill worker, a finished prefill's KV is held and announced (:meth:`TransferHandoff.hand_off`);
on a decode worker, the prompt's KV is pulled into reserved blocks, retried once, or the request
falls back to a local prefill when the router allowed it (:meth:`TransferHandoff.receive`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import structlog

from kvmesh.common.rpc.status_error import StatusError
from kvmesh.common.wire.disagg import DecodeOrder, KvReady, KvSource, PrefillOrder
from kvmesh.worker.engine import Engine, EngineRequestSpec, TokenOutput, TokenQueue, transferable_blocks
from kvmesh.worker.kv_transfer.transport import KvTransferClient, KvTransferServer, TransferError, TransferStats

log = structlog.get_logger(__name__)


@dataclass
class KvTransfer:
    """This worker's two ends of a KV transfer and where others reach its server."""

    server: KvTransferServer
    client: KvTransferClient
    host: str

    @property
    def backend(self) -> str:
        return self.server.backend

    @property
    def stats(self) -> TransferStats:
        """Shared by server and client: what moved, both ways."""
        return self.server.stats


class KvHandoff(Protocol):
    """A worker's half of disaggregation, whoever moves the bytes (the worker's transfer server, or
    the engine's own connector)."""

    @property
    def backend(self) -> str: ...

    def transfers_in_flight(self) -> int: ...

    def hand_off(self, spec: EngineRequestSpec, order: PrefillOrder, last: TokenOutput) -> KvReady:
        """The prefill finished (``last`` is its final output): where its KV waits."""
        ...

    def prefill_failed(self, order: PrefillOrder, reason: str) -> None: ...

    async def receive(self, spec: EngineRequestSpec, order: DecodeOrder) -> tuple[TokenQueue, KvSource]:
        """Submit a decode request whose prompt KV comes from the prefill worker; its token queue and
        where the KV came from."""
        ...


class TransferHandoff:
    """Moves prompts' KV between this worker's engine and other workers' over the worker's own
    transfer server and client (the mock engine's blocks)."""

    def __init__(self, worker_id: int, engine: Engine, transfer: KvTransfer, timeout_s: float) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.transfer = transfer
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Future[None]] = set()

    # ---- prefill side ----------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self.transfer.backend

    def transfers_in_flight(self) -> int:
        return self.transfer.stats.in_flight

    def hand_off(self, spec: EngineRequestSpec, order: PrefillOrder, last: TokenOutput) -> KvReady:
        """The prefill is done: hold its transferable blocks for the room, say where they are."""
        count = transferable_blocks(len(spec.prompt), self.engine.block_size)
        slots = self.engine.held_slots(spec.request_id, count)
        self.transfer.server.ready(order.room, spec.request_id, slots, last.cached_tokens)
        return KvReady(
            room=order.room,
            host=self.transfer.host,
            port=self.transfer.server.port,
            worker_id=self.worker_id,
            blocks=count,
            backend=self.transfer.backend,
            cached_tokens=last.cached_tokens,
        )

    def prefill_failed(self, order: PrefillOrder, reason: str) -> None:
        """The prefill will never finish: a decode worker waiting in the room is told so."""
        self.transfer.server.fail(order.room, reason)

    # ---- decode side -----------------------------------------------------------------------
    async def receive(self, spec: EngineRequestSpec, order: DecodeOrder) -> tuple[TokenQueue, KvSource]:
        """Pull the prompt's KV from the prefill worker into reserved blocks (one retry), or fall
        back to a local prefill when allowed. Returns the request's token queue and where its KV
        came from; raises :class:`StatusError` when the KV cannot come and local prefill is not
        allowed."""
        plan, queue = self.engine.reserve_remote(spec)
        if plan is None or plan.num_blocks == 0:
            reason = "decode_memory" if plan is None else "cached"
            if plan is None and not order.allow_local:
                raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV memory free to receive the prefill")
            # Let the prefill worker release what it holds for us, without making this request wait.
            self._background(self._decline(order))
            if plan is None:
                queue = self.engine.submit(spec)
            else:
                self.engine.finish_transfer(spec.request_id, True)
            return queue, KvSource.local(reason)
        error = "no attempt"
        for attempt in (1, 2):
            try:
                result = await self.transfer.client.pull(
                    order.host,
                    order.port,
                    order.room,
                    plan.first_block,
                    plan.slots,
                    plan.sequence_hashes,
                    self.timeout_s,
                )
            except TransferError as exc:
                error = str(exc)
                log.warning("KV transfer failed", attempt=attempt, error=error, prefill_worker=order.worker_id)
                if not exc.retryable:
                    break
                continue
            self.engine.finish_transfer(spec.request_id, True)
            log.info(
                "KV received",
                backend=result.backend,
                blocks=plan.num_blocks,
                bytes=result.bytes,
                ms=round(result.seconds * 1000, 3),
                cached_blocks=plan.first_block,
            )
            source = KvSource(
                "remote",
                backend=result.backend,
                bytes=result.bytes,
                blocks=plan.num_blocks,
                cached_tokens=result.prefill_cached_tokens,
            )
            return queue, source
        if not order.allow_local:
            raise StatusError(
                grpc.StatusCode.UNAVAILABLE, f"remote prefill failed and local prefill is not allowed: {error}"
            )
        self.engine.finish_transfer(spec.request_id, False)
        return queue, KvSource.local("transfer_failed")

    async def _decline(self, order: DecodeOrder) -> None:
        try:
            await self.transfer.client.pull(order.host, order.port, order.room, 0, [], [], self.timeout_s)
        except TransferError as exc:
            log.info("could not release a prefill's held KV; it expires on its own", error=str(exc))

    def _background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
