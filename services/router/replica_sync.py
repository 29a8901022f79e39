"""Router replicas share their load picture (DESIGN §5) over NATS core.

Every replica publishes the three events of a request's life — AddRequest, MarkPrefillCompleted,
Free — on ``kvmesh.<namespace>.router.sync`` (msgpack, carrying its ``router_id``) and applies the
other replicas' events to its own :class:`ActiveSequences`; it ignores its own. Each replica also
sends a heartbeat; the requests of a replica that has been silent for ``silence_timeout_s`` are
dropped, so a crashed router leaves no phantom load. A new replica starts empty and converges as
requests come and go.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import structlog
from nats.aio.client import Client as NatsClient

from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.wire import names
from kvmesh.router.sync_messages import ADD, FREE, HEARTBEAT, PREFILL_DONE, SyncMessage

log = structlog.get_logger(__name__)


class ReplicaSync:
    """Publishes this replica's request events and feeds the others' to ``apply``.

    ``forget(router_id)`` is called once for a replica silent longer than ``silence_timeout_s``.
    """

    def __init__(
        self,
        nc: NatsClient,
        namespace: str,
        router_id: str,
        apply: Callable[[SyncMessage], None],
        forget: Callable[[str], None],
        heartbeat_s: float = 1.0,
        silence_timeout_s: float = 5.0,
    ) -> None:
        self._nc = nc
        self.subject = names.router_sync_subject(namespace)
        self.router_id = router_id
        self._apply = apply
        self._forget = forget
        self.heartbeat_s = heartbeat_s
        self.silence_timeout_s = silence_timeout_s
        self._last_seen: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._sub = None
        self.received = 0

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self.subject, cb=self._on_message)
        self._tasks = [
            asyncio.create_task(self._heartbeat_forever(), name="sync-heartbeat"),
            asyncio.create_task(self._forget_silent_forever(), name="sync-silence"),
        ]
        await self._send(SyncMessage(HEARTBEAT, self.router_id))

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    def peers(self) -> list[str]:
        return sorted(self._last_seen)

    # ---- publishing ---------------------------------------------------------------------
    def added(
        self,
        request_id: str,
        worker: tuple[int, int],
        block_size: int,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        overlap_blocks: int,
        expected_output_tokens: int = 0,
        session: str = "",
    ) -> None:
        self._publish(
            SyncMessage(
                ADD,
                self.router_id,
                request_id,
                worker[0],
                worker[1],
                block_size,
                tuple(block_hashes),
                prompt_tokens,
                overlap_blocks,
                expected_output_tokens,
                session,
            )
        )

    def prefill_completed(self, request_id: str) -> None:
        self._publish(SyncMessage(PREFILL_DONE, self.router_id, request_id))

    def freed(self, request_id: str) -> None:
        self._publish(SyncMessage(FREE, self.router_id, request_id))

    def _publish(self, message: SyncMessage) -> None:
        # nats-py buffers a publish and flushes it from its own task: ordering per replica is kept
        asyncio.get_running_loop().create_task(self._send(message))

    async def _send(self, message: SyncMessage) -> None:
        try:
            await self._nc.publish(self.subject, message.encode())
        except Exception as exc:  # a lost sync message is healed by the silence timeout at worst
            log.warning("replica sync publish failed", error=str(exc))

    # ---- receiving ----------------------------------------------------------------------
    async def _on_message(self, msg) -> None:
        try:
            message = SyncMessage.decode(msg.data)
        except Exception as exc:
            log.warning("ignoring a malformed sync message", error=str(exc))
            return
        if message.router_id == self.router_id:
            return
        if message.router_id not in self._last_seen:
            log.info("router replica joined", peer=message.router_id)
        self._last_seen[message.router_id] = time.monotonic()
        self.received += 1
        if message.kind != HEARTBEAT:
            self._apply(message)

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self._send(SyncMessage(HEARTBEAT, self.router_id))

    async def _forget_silent_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            for peer in [p for p, seen in self._last_seen.items() if now - seen > self.silence_timeout_s]:
                del self._last_seen[peer]
                log.warning("router replica went silent; dropping its requests", peer=peer)
                self._forget(peer)
