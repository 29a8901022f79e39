"""Following a durable JetStream pull consumer with standing pull requests.

nats-py's ``PullSubscription.fetch`` sends a no-wait probe and then a waiting request on every call,
and returns as soon as anything arrived: an indexer that keeps up gets one or two messages per call,
so each KV event message costs two pull requests, a "no messages" reply and the message, through
nats-server and the indexer. Here a pull request for up to ``batch`` messages stands on the server
and is topped up when half of it has been delivered, so a message costs its delivery and its ack
(the pattern of the NATS clients' "consume"; docs/decisions/0022).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable

import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import Header

from kvmesh.common.rpc.tasks import cancel_and_wait

log = structlog.get_logger(__name__)

IDLE_HEARTBEAT = "100"
# the request expired, or the server dropped it (max waiting, leadership change, consumer deleted)
ENDED_STATUSES = ("408", "409")
NO_RESPONDERS = "503"  # no such consumer (yet): asking again at once would spin
PENDING_MESSAGES = "Nats-Pending-Messages"


class StandingPull:
    """Delivers a durable pull consumer's messages, in order, to ``handle`` (awaited one at a time).

    Guarantees: at most ``batch`` messages are requested ahead of what ``handle`` has been given;
    a pull request the server ended (expired, dropped) is replaced at once; one nobody answered
    (the consumer is missing) or one lost without word (a restarted server) is replaced after two
    idle heartbeats of silence, or at the next check after a reconnect; and when no message came
    for two heartbeats while the consumer holds messages and no request of ours (a consumer
    leader deposed after a partition may keep sending heartbeats for a request the new leader
    never got), the request is replaced too. Status messages never reach ``handle``;
    acknowledging is ``handle``'s business."""

    def __init__(
        self,
        nc: NatsClient,
        stream: str,
        durable: str,
        handle: Callable[[Msg], Awaitable[None]],
        *,
        batch: int = 256,
        expires_s: float = 30.0,
        heartbeat_s: float = 5.0,
        check_s: float = 1.0,
    ) -> None:
        if not 0 < 2 * heartbeat_s < expires_s:
            raise ValueError("two idle heartbeats must fit in a pull request's life")
        self._nc = nc
        self._stream = stream
        self._durable = durable
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._handle = handle
        self._batch = batch
        self._expires_ns = int(expires_s * 1e9)
        self._heartbeat_s = heartbeat_s
        self._check_s = check_s
        self._inbox = ""
        self._sub: Subscription | None = None
        self._watch: asyncio.Task[None] | None = None
        # messages asked for and not yet delivered, over all standing requests
        self._pending = 0
        self._last_heard = 0.0
        self._last_message = 0.0  # the last message for handle (not a status)
        self._reconnects = 0
        self.requests_sent = 0

    async def start(self) -> None:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_message)
        self._reconnects = self._nc.stats["reconnects"]
        self._last_heard = self._last_message = time.monotonic()
        await self._top_up()
        self._watch = asyncio.create_task(self._watch_requests(), name=f"pull-{self._next_subject}")

    async def stop(self) -> None:
        await cancel_and_wait(self._watch)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _on_message(self, msg: Msg) -> None:
        self._last_heard = time.monotonic()
        status = msg.headers.get(Header.STATUS) if msg.headers else None
        if status is None:
            self._last_message = self._last_heard
            self._pending -= 1
            await self._handle(msg)
        elif status == NO_RESPONDERS:
            log.warning("no JetStream consumer answered the pull request; asking again shortly")
            self._pending = 0
            return  # the watcher asks again after its silence
        elif status in ENDED_STATUSES:
            self._pending -= _int_header(msg, PENDING_MESSAGES, default=self._pending)
            if status == "409":
                log.warning("pull request ended by the server", description=msg.headers.get(Header.DESCRIPTION))
        elif status != IDLE_HEARTBEAT:
            log.warning(
                "unexpected status on the pull inbox", status=status, description=msg.headers.get(Header.DESCRIPTION)
            )
        if self._pending <= self._batch // 2:
            await self._top_up()

    async def _top_up(self) -> None:
        wanted = self._batch - max(self._pending, 0)
        request = {"batch": wanted, "expires": self._expires_ns, "idle_heartbeat": int(self._heartbeat_s * 1e9)}
        await self._nc.publish(self._next_subject, json.dumps(request).encode(), reply=self._inbox)
        self._pending = max(self._pending, 0) + wanted
        self.requests_sent += 1

    async def _watch_requests(self) -> None:
        """Replace standing requests the server can no longer answer: after a reconnect, once two
        idle heartbeats went unheard, or once messages wait at a consumer that holds no request."""
        while True:
            await asyncio.sleep(self._check_s)
            reconnects = self._nc.stats["reconnects"]
            now = time.monotonic()
            silent = now - self._last_heard > 2 * self._heartbeat_s
            reason = "reconnected" if reconnects != self._reconnects else "silence" if silent else None
            if reason is None and now - self._last_message > 2 * self._heartbeat_s:
                self._last_message = now  # asked at most once per two heartbeats
                if await self._starved():
                    reason = "messages wait at a consumer that holds no request of ours"
            if reason is not None:
                self._reconnects = reconnects
                self._last_heard = self._last_message = time.monotonic()
                log.info("renewing the standing pull request", reason=reason)
                self._pending = 0
                with contextlib.suppress(Exception):  # disconnected: the next check tries again
                    await self._top_up()

    async def _starved(self) -> bool:
        """Whether the consumer's leader holds messages for us and no pull request to send them on."""
        try:
            info = await self._nc.jetstream(timeout=2 * self._heartbeat_s).consumer_info(self._stream, self._durable)
        except Exception:  # no answer: silence or a reconnect will tell
            return False
        return bool(info.num_pending) and not info.num_waiting


def _int_header(msg: Msg, name: str, default: int) -> int:
    try:
        return int(msg.headers.get(name, default))
    except (TypeError, ValueError):
        return default
