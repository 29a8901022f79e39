"""Feeds the prefix index from the KV event stream through a durable pull consumer (DESIGN §4),
followed with standing pull requests (:mod:`kvmesh.indexer.standing_pull`).

Restart semantics (docs/decisions/0002). The index lives in memory, so a restarted replica must
rebuild it before its durable consumer is useful. On start the replica

1. restores the latest snapshot, if any, which covers the stream up to its sequence ``S`` (else S=0);
2. reads how far its durable consumer delivered, ``D`` (0 if the consumer is new); everything up
   to its acknowledgement floor was applied by the previous process, and the messages after the
   floor up to ``D`` were delivered to it but perhaps not applied;
3. replays the stream's messages ``S+1..D`` through a short-lived read without acks;
4. resumes the durable consumer, which delivers from ``D + 1``; the messages it redelivers after
   its ack wait (delivered but never acknowledged) are then skipped as applied. A new durable
   starts at ``S + 1``.

So a replica acknowledges only what it applied, resumes from its durable consumer after a restart,
and still ends with exactly the state of a replica that never stopped. Where the stream no longer
holds messages it must replay (aged out while it was away, or purged), ``on_lost`` has every
worker rebuilt from its own dump (gap recovery).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.wire import names
from kvmesh.common.wire.kv_events import EventDecodeError, decode_batch
from kvmesh.indexer.standing_pull import StandingPull

log = structlog.get_logger(__name__)

FETCH_BATCH = 256
# Acknowledgements: one for the last message applied, within this long or after this many messages
# (the durable acks all earlier ones with it). One ack per message was a third of the stream's NATS
# traffic at the indexer and the server. A replica that dies first loses nothing: the next one
# replays up to what the durable delivered (docs/decisions/0029).
ACK_WINDOW_S = 0.005
ACK_EVERY = 64
# The stream keeps a message an hour by default (--kv-events-max-age): a durable idle longer points
# at what has aged out anyway, and while it lives it holds the namespace's purge floor.
DURABLE_INACTIVE_THRESHOLD_S = 3600.0
# How long a replay keeps asking a stream that holds the messages but does not answer (its leader
# still recovering from a partition) before it gives them up to gap recovery.
REPLAY_PATIENCE_S = 60.0
REPLAY_RETRY_S = 0.5


class EventStreamConsumer:
    """Applies stream messages to ``index`` in stream order.

    Guarantees: a message is acknowledged only once it and every message before it are applied.
    The durable acknowledges all (``AckPolicy.ALL``): the last message applied is acknowledged
    within ``ACK_WINDOW_S`` or after ``ACK_EVERY`` messages, which acknowledges the earlier ones."""

    def __init__(
        self,
        nc: NatsClient,
        namespace: str,
        replica_id: str,
        index: PrefixIndex,
        on_applied: Callable[[int], None] | None = None,
        inactive_threshold_s: float = DURABLE_INACTIVE_THRESHOLD_S,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        """``inactive_threshold_s``: the server deletes the durable after this long without this
        replica (a replica scaled away must not pin the purge floor for ever). ``on_lost``: called
        when messages this replica never applied are gone from the stream (or it gave up asking),
        so that every worker is rebuilt from its own state."""
        self._nc = nc
        self._js = nc.jetstream()
        self._subject = names.kv_events_wildcard(namespace)
        self.durable = names.indexer_durable_name(namespace, replica_id)
        self._legacy_durable = names.legacy_indexer_durable_name(replica_id)
        self._inactive_threshold_s = inactive_threshold_s
        self._index = index
        self._on_applied = on_applied
        self._on_lost = on_lost
        self.applied_sequence = 0
        self.malformed_messages = 0
        self.missed_deliveries = 0
        self.replay_retries = 0  # reads of missed messages asked again (the stream did not answer)
        self._pull: StandingPull | None = None
        # the durable's count of deliveries when we last heard from it: a jump means deliveries that
        # never reached us (see _apply_and_ack)
        self._consumer_sequence = 0
        self._last_unacked: Msg | None = None
        self._unacked = 0
        self._ack_due = asyncio.Event()
        self._acker: asyncio.Task[None] | None = None

    async def start(self, reset: bool = False, start_after: int = 0) -> None:
        """Catch up to what the durable last delivered, then follow the durable.

        ``start_after`` is the stream sequence the index already reflects (a restored snapshot).
        """
        if reset:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self._js.delete_consumer(names.KV_EVENTS_STREAM, self.durable)
        await self._drop_legacy_durable()
        self.applied_sequence = start_after
        ack_floor, delivered, ack_policy, self._consumer_sequence, existing = await self._position()
        if delivered > start_after:
            await self._replay(delivered)
        if ack_floor is not None and ack_policy != AckPolicy.ALL:
            # a durable from before acks were batched: the policy cannot be changed in place, so
            # it is made again, to deliver after what was just replayed
            await self._js.delete_consumer(names.KV_EVENTS_STREAM, self.durable)
            log.info("remaking the durable consumer to acknowledge all", durable=self.durable, ack_floor=ack_floor)
            start_after, ack_floor = max(start_after, self.applied_sequence), None
        if ack_floor is None:
            config = ConsumerConfig(
                durable_name=self.durable,
                ack_policy=AckPolicy.ALL,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start_after else DeliverPolicy.ALL,
                opt_start_seq=start_after + 1 if start_after else None,
                filter_subject=self._subject,
                max_ack_pending=-1,
                ack_wait=30,
                inactive_threshold=self._inactive_threshold_s,
            )
            await self._js.add_consumer(names.KV_EVENTS_STREAM, config)
        elif existing is not None and existing.inactive_threshold != self._inactive_threshold_s:
            # an editable field: the durable keeps its position
            existing.inactive_threshold = self._inactive_threshold_s
            await self._js.add_consumer(names.KV_EVENTS_STREAM, existing)
        self._pull = StandingPull(
            self._nc, names.KV_EVENTS_STREAM, self.durable, self._apply_and_ack, batch=FETCH_BATCH
        )
        self._acker = asyncio.create_task(self._ack_forever(), name=f"ack-{self.durable}")
        await self._pull.start()
        log.info(
            "following the event stream",
            durable=self.durable,
            snapshot=start_after,
            resumed_after=self.applied_sequence,
        )

    async def stop(self) -> None:
        if self._pull is not None:
            await self._pull.stop()
        await cancel_and_wait(self._acker)
        await self._ack_last()

    async def _position(self) -> tuple[int | None, int, AckPolicy | None, int, ConsumerConfig | None]:
        """The durable consumer's ack floor, the last stream sequence it delivered, its ack policy,
        how many deliveries it made and its configuration; ``(None, 0, None, 0, None)`` when it does
        not exist yet."""
        try:
            info = await self._js.consumer_info(names.KV_EVENTS_STREAM, self.durable)
        except nats.js.errors.NotFoundError:
            return None, 0, None, 0, None
        ack_floor = info.ack_floor.stream_seq if info.ack_floor else 0
        delivered = info.delivered.stream_seq if info.delivered else 0
        deliveries = info.delivered.consumer_seq if info.delivered else 0
        return ack_floor, max(ack_floor, delivered), info.config.ack_policy, deliveries, info.config

    async def _drop_legacy_durable(self) -> None:
        """Delete this replica's durable of the name before namespaces were in it, when it follows
        this namespace: it would hold the purge floor until it expired. The new durable starts after
        the snapshot, which the purge floor kept the stream above, so nothing is lost."""
        try:
            info = await self._js.consumer_info(names.KV_EVENTS_STREAM, self._legacy_durable)
        except nats.js.errors.NotFoundError:
            return
        if info.config.filter_subject == self._subject:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self._js.delete_consumer(names.KV_EVENTS_STREAM, self._legacy_durable)
            log.info("dropped the durable consumer named before namespaces", durable=self._legacy_durable)

    async def _replay(self, last_sequence: int) -> None:
        """Apply the messages after the last one applied up to ``last_sequence``, from the stream.
        It stops short only where the stream no longer holds the rest (purged or aged out) or has
        not answered for ``REPLAY_PATIENCE_S``. A read that timed out once had been taken for
        "purged", so a stream that did not answer for one fetch (its server paused, a leader still
        being elected) lost the missed messages for good: the next acknowledgement covers them."""
        deadline = asyncio.get_running_loop().time() + REPLAY_PATIENCE_S
        error = ""
        while self.applied_sequence < last_sequence:
            try:
                await self._read(last_sequence)
            except (TimeoutError, nats.errors.Error) as exc:
                error = f"{type(exc).__name__}: {exc}"
            else:
                error = "no more messages came"
            if self.applied_sequence >= last_sequence or not await self._stream_may_hold(last_sequence):
                break
            if asyncio.get_running_loop().time() > deadline:
                break
            self.replay_retries += 1
            log.warning("reading missed messages again", after=self.applied_sequence, up_to=last_sequence, error=error)
            await asyncio.sleep(REPLAY_RETRY_S)
        if self.applied_sequence < last_sequence:
            # Gap recovery alone would rebuild only the workers whose later events reveal the hole;
            # a worker that published nothing since would stay wrong for good.
            log.error("gave up on missed messages", after=self.applied_sequence, up_to=last_sequence, error=error)
            if self._on_lost is not None:
                self._on_lost()
        log.info("replayed stream into the index", up_to=self.applied_sequence)

    async def _read(self, last_sequence: int) -> None:
        """Apply the messages after the applied one up to ``last_sequence`` with an ephemeral
        consumer that needs no acks, until one past it comes or none comes within a fetch."""
        sub = await self._js.pull_subscribe(
            self._subject,
            stream=names.KV_EVENTS_STREAM,
            config=ConsumerConfig(
                ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=self.applied_sequence + 1,
                inactive_threshold=30,
            ),
        )
        try:
            while self.applied_sequence < last_sequence:
                try:
                    msgs = await sub.fetch(FETCH_BATCH, timeout=2)
                except TimeoutError:
                    return
                for msg in msgs:
                    seq = msg.metadata.sequence.stream
                    if seq > last_sequence:
                        return
                    self._apply(msg.data, seq)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _stream_may_hold(self, last_sequence: int) -> bool:
        """Whether the stream may still hold messages up to ``last_sequence`` that were not read:
        False once its first message is past them (purged or aged out); True when it does not say."""
        try:
            info = await self._js.stream_info(names.KV_EVENTS_STREAM)
        except (TimeoutError, nats.errors.Error):
            return True
        return info.state.first_seq <= last_sequence

    async def _apply_and_ack(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        deliveries = msg.metadata.sequence.consumer
        if deliveries > self._consumer_sequence + 1 and seq > self.applied_sequence + 1:
            # The durable delivered messages that never reached us: to a pull request lost with a
            # consumer leader that a partition deposed, or one renewed while they travelled. It
            # counts them delivered, and acknowledging this message would acknowledge them too
            # (AckPolicy.ALL), so no redelivery would come: read them from the stream first.
            log.warning(
                "deliveries did not reach this replica; reading them from the stream",
                missed_deliveries=deliveries - self._consumer_sequence - 1,
                after=self.applied_sequence,
                before=seq,
            )
            self.missed_deliveries += deliveries - self._consumer_sequence - 1
            await self._replay(seq - 1)
        # assigned, not maxed: a new consumer leader that lost uncommitted deliveries counts again
        self._consumer_sequence = deliveries
        if seq > self.applied_sequence:  # else a redelivery of what is applied already
            self._apply(msg.data, seq)
        self._last_unacked = msg
        self._unacked += 1
        if self._unacked >= ACK_EVERY:
            await self._ack_last()
        else:
            self._ack_due.set()

    async def _ack_forever(self) -> None:
        while True:
            await self._ack_due.wait()
            await asyncio.sleep(ACK_WINDOW_S)
            await self._ack_last()

    async def _ack_last(self) -> None:
        """Acknowledge the last message applied, and with it every earlier one."""
        msg, self._last_unacked, self._unacked = self._last_unacked, None, 0
        self._ack_due.clear()
        if msg is None:
            return
        try:
            await msg.ack()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # unacked: redelivered later and skipped as already applied
            log.warning("ack failed", sequence=msg.metadata.sequence.stream, error=str(exc))

    def _apply(self, payload: bytes, sequence: int) -> None:
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            # A poison message must not stall the replica: count it, log it, move on.
            self.malformed_messages += 1
            log.error("skipping malformed KV event message", sequence=sequence, error=str(exc))
        else:
            self._index.apply_batch(batch)
        self.applied_sequence = sequence
        if self._on_applied is not None:
            self._on_applied(sequence)
