"""Service discovery on the NATS KV bucket ``KVMESH_INSTANCES`` (DESIGN §6).

Every worker, router and indexer writes one msgpack record under
``<namespace>.<component>.<instance_id>`` and rewrites it every third of its lease. Watchers drop an
instance when its key is deleted (graceful shutdown) *or* when it has not been refreshed within its
lease: a crashed process simply stops refreshing, and every watcher forgets it within one lease.
Expiry is judged by the watcher from the record's server timestamp, so it does not depend on the
server's own key expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC
from typing import Any

import msgpack
import structlog
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.runtime.jetstream_state import ensure_key_value, latest_entry, when_jetstream_answers
from kvmesh.common.wire import names

log = structlog.get_logger(__name__)

DEFAULT_LEASE_TTL = 6.0
# Keys outlive a lease on the server only as a safety net; watchers expire them from the lease.
BUCKET_MAX_AGE = 60.0


def new_instance_id() -> int:
    """A random 63-bit instance id: a restarted process is a new instance and starts clean."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class InstanceRecord:
    """What one instance tells the mesh about itself."""

    component: str
    instance_id: int
    address: str
    namespace: str = names.DEFAULT_NAMESPACE
    role: str = ""
    model: str = ""
    block_size: int = 0
    capacity_blocks: int = 0
    lease_ttl: float = DEFAULT_LEASE_TTL
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return names.instance_key(self.namespace, self.component, self.instance_id)

    def encode(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def decode(cls, payload: bytes) -> InstanceRecord:
        raw = msgpack.unpackb(payload)
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)


async def instances_bucket(js: JetStreamContext) -> KeyValue:
    """Open the discovery bucket, creating it replicated on first use (safe when several processes race)."""
    return await ensure_key_value(js, KeyValueConfig(bucket=names.INSTANCES_BUCKET, history=1, ttl=BUCKET_MAX_AGE))


# Longest start() waits for records the server listed but has not delivered yet.
INITIAL_KEYS_TIMEOUT_S = 5.0

# Longest a watcher waits for the bucket's word on a lease that ran out.
LEASE_CHECK_TIMEOUT_S = 2.0
# A lease refresh not answered this fast is tried again after RETRY_AFTER_FAILED_REFRESH_S.
REFRESH_TIMEOUT_S = 1.0
# Leases a watcher holds instances past their expiry when most of a component lapsed at once.
MASS_EXPIRY_HOLD_LEASES = 2.0
RETRY_AFTER_FAILED_REFRESH_S = 0.5
# How often a watcher compares its view with the bucket's keys, for records its watch never delivered.
CATCH_UP_INTERVAL_S = 5.0

# Longest a deregistration step may hold up a shutdown.
STOP_TIMEOUT_S = 2.0


class Registration:
    """Keeps one instance's record alive in the discovery bucket until :meth:`stop`."""

    def __init__(self, js: JetStreamContext, record: InstanceRecord) -> None:
        self._js = js
        self.record = record
        self._kv: KeyValue | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._kv = await instances_bucket(self._js)
        kv = self._kv
        await when_jetstream_answers(lambda: kv.put(self.record.key, self.record.encode()), "registration")
        self._task = asyncio.create_task(self._refresh_forever(), name=f"lease-{self.record.key}")
        log.info("registered", key=self.record.key, address=self.record.address)

    async def update(self, record: InstanceRecord) -> None:
        """Publish a changed record now; if NATS is unreachable, the next lease refresh (which writes
        the current record) publishes it instead, so a NATS outage never fails the caller."""
        self.record = record
        if self._kv is not None:
            try:
                await self._kv.put(record.key, record.encode())
            except Exception as exc:  # an outage: the refresh loop retries with this record
                log.warning("record update deferred to the next lease refresh", key=record.key, error=str(exc))

    async def _refresh_forever(self) -> None:
        assert self._kv is not None
        period = self.record.lease_ttl / 3
        # A write JetStream does not answer (its stream electing a leader) is given up after a
        # fraction of the period and tried again soon: the record must be refreshed the moment the
        # bucket answers again, before watchers that held it through the outage drop it.
        timeout = min(REFRESH_TIMEOUT_S, period)
        wait = period
        while True:
            await asyncio.sleep(wait)
            try:
                await asyncio.wait_for(self._kv.put(self.record.key, self.record.encode()), timeout)
                wait = period
            except Exception as exc:  # NATS hiccup: try again soon; the lease has slack
                log.warning("lease refresh failed", key=self.record.key, error=f"{type(exc).__name__}: {exc}")
                wait = min(period, RETRY_AFTER_FAILED_REFRESH_S)

    async def stop(self) -> None:
        # Deleting tells watchers at once; if NATS is slow, the lease expiring does the same later,
        # so shutdown never waits long for it. asyncio.wait (not wait_for) bounds each step even
        # when a NATS call does not give way to cancellation at once: a refresh or delete stuck in
        # a JetStream request held shutdown for 15 s that way. A refresh that swallowed its
        # cancellation (Python 3.11's wait_for) is cancelled again until it ends, past the bound if
        # need be, so it cannot put the record back after the delete.
        if self._task is not None:
            stopping = asyncio.ensure_future(cancel_and_wait(self._task))
            await asyncio.wait({stopping}, timeout=STOP_TIMEOUT_S)
        if self._kv is None:
            return
        delete = asyncio.ensure_future(self._kv.delete(self.record.key))
        done, _ = await asyncio.wait({delete}, timeout=STOP_TIMEOUT_S)
        error = "timed out" if not done else (str(delete.exception()) if delete.exception() else None)
        if not done:
            delete.cancel()
        if error is not None:
            log.warning("could not deregister; the lease will expire", key=self.record.key, error=error)
        else:
            log.info("deregistered", key=self.record.key)
        self._kv = None  # stopped: a second stop does nothing


InstanceCallback = Callable[[InstanceRecord], Awaitable[None] | None]


class DiscoveryWatcher:
    """Live view of one component's instances in a namespace.

    Guarantees: :meth:`instances` holds every instance whose record was written or refreshed within
    its lease, from the watch at once or, where the watch lost it, from the bucket within
    ``CATCH_UP_INTERVAL_S``; ``on_removed`` is called exactly once for an instance that leaves (deleted or
    expired), ``on_added`` once when an instance is first seen.
    """

    def __init__(
        self,
        js: JetStreamContext,
        namespace: str,
        component: str,
        on_added: InstanceCallback | None = None,
        on_removed: InstanceCallback | None = None,
    ) -> None:
        self._js = js
        self._prefix = names.instance_key_prefix(namespace, component)
        self._on_added = on_added
        self._on_removed = on_removed
        self._records: dict[int, InstanceRecord] = {}
        self._expires_at: dict[int, float] = {}
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._watcher: Any = None
        # Every key the watch has delivered, in any state; kept only until start() returns.
        self._handled_keys: set[str] | None = set()
        self._holding = False  # the bucket did not answer a lease check
        self._kv: KeyValue | None = None
        self._probe_key = names.watcher_probe_key(namespace, secrets.token_hex(8))
        self._grace_until = 0.0  # after an outage of the bucket, no instance is dropped before this
        self._mass_since: float | None = None  # when most instances' leases lapsed together

    def instances(self) -> list[InstanceRecord]:
        return list(self._records.values())

    def get(self, instance_id: int) -> InstanceRecord | None:
        return self._records.get(instance_id)

    async def start(self) -> None:
        """Start watching; returns once every key present before the call has been handled, so
        :meth:`instances` is complete from the first read."""
        kv = self._kv = await instances_bucket(self._js)
        present = await when_jetstream_answers(self._present_keys, "discovery keys", made=True)
        self._watcher = await when_jetstream_answers(lambda: kv.watch(self._prefix + "*"), "discovery watch", made=True)
        initial_done = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._consume(initial_done), name=f"watch-{self._prefix}"),
            asyncio.create_task(self._expire_forever(), name=f"expire-{self._prefix}"),
        ]
        await initial_done.wait()
        # nats-py's "no more pending" marker is decided from the consumer's pending count, which the
        # server may lower before the message reaches us: under load a watcher could report "done"
        # with no instances at all (seen in CI). The stream's own list of keys closes that gap.
        try:
            await self._wait_for_keys(present, timeout=INITIAL_KEYS_TIMEOUT_S)
        except TimeoutError:  # a key purged between the two reads never arrives: nothing is lost
            log.warning("some instance records did not arrive", missing=sorted(present - (self._handled_keys or set())))
        self._handled_keys = None

    async def _present_keys(self) -> set[str]:
        subject = f"$KV.{names.INSTANCES_BUCKET}.{self._prefix}*"
        info = await self._js.stream_info(f"KV_{names.INSTANCES_BUCKET}", subjects_filter=subject)
        prefix_len = len(f"$KV.{names.INSTANCES_BUCKET}.")
        return {s[prefix_len:] for s in (info.state.subjects or {})}

    async def _wait_for_keys(self, keys: set[str], timeout: float) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: keys <= (self._handled_keys or set()))

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()

    async def wait_for(self, predicate: Callable[[list[InstanceRecord]], bool], timeout: float) -> None:
        """Wait until ``predicate(instances)`` holds; raises ``TimeoutError`` after ``timeout`` s."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: predicate(self.instances()))

    async def _consume(self, initial_done: asyncio.Event) -> None:
        async for entry in self._watcher:
            if entry is None:  # the watcher has delivered every existing key
                initial_done.set()
                continue
            if self._handled_keys is not None:
                self._handled_keys.add(entry.key)
                async with self._changed:
                    self._changed.notify_all()  # start() waits on _handled_keys
            instance_id = _instance_id_from_key(entry.key)
            if instance_id is None:
                continue
            if entry.operation in (KV_DEL, KV_PURGE):
                await self._remove(instance_id, reason="deleted")
            else:
                try:
                    record = InstanceRecord.decode(entry.value)
                except Exception as exc:
                    log.warning("ignoring malformed instance record", key=entry.key, error=str(exc))
                    continue
                written_at = entry.created.replace(tzinfo=UTC).timestamp() if entry.created else time.time()
                await self._upsert(record, written_at)
            if not initial_done.is_set() and entry.delta == 0:
                initial_done.set()

    async def _upsert(self, record: InstanceRecord, written_at: float) -> None:
        expires_at = written_at + record.lease_ttl
        if expires_at <= time.time():
            return  # a stale record of an instance that died before we started watching
        known = self._records.get(record.instance_id)
        is_new = known is None
        if known != record:  # a lease refresh rewrites the same record: the one held stays, so that
            # what a reader derived from it and keyed on it stays good (the router's candidate tables)
            self._records[record.instance_id] = record
        self._expires_at[record.instance_id] = expires_at
        if is_new:
            log.info("instance joined", key=record.key, address=record.address)
            await _call(self._on_added, record)
        async with self._changed:
            self._changed.notify_all()

    async def _remove(self, instance_id: int, reason: str) -> None:
        record = self._records.pop(instance_id, None)
        self._expires_at.pop(instance_id, None)
        if record is None:
            return
        log.info("instance left", key=record.key, reason=reason)
        await _call(self._on_removed, record)
        async with self._changed:
            self._changed.notify_all()

    async def _expire_forever(self) -> None:
        next_catch_up = time.monotonic() + CATCH_UP_INTERVAL_S
        while True:
            await asyncio.sleep(0.5)
            if time.monotonic() >= next_catch_up:
                next_catch_up = time.monotonic() + CATCH_UP_INTERVAL_S
                await self._catch_up()
            now = time.time()
            due = [i for i, t in self._expires_at.items() if t <= now]
            if not due or self._mass_expiry(due, now) or not await self._bucket_takes_writes():
                continue
            for instance_id in due:
                if not await self._expire_unless_refreshed(instance_id):
                    break  # the bucket does not answer: ask again next round

    def _mass_expiry(self, due: list[int], now: float) -> bool:
        """Whether to hold ``due`` a while longer because most of the component lapsed at once (lapsed
        or silent for over half a lease when the first lapses). Hosts fail one at a time; more than
        half of the instances (two or more) lapsing together is far
        likelier their refreshes failing (their NATS server cut off, its peers electing leaders)
        than all of them dying, and dropping them would empty the view (seen in a partition drill:
        every router gone from a frontend's view, 229 requests refused). They are held up to two
        leases past the first such round; one that stays silent is dropped after that, as ever."""
        longest = max((self._records[i].lease_ttl for i in due if i in self._records), default=0.0)
        # lapsed, or silent for over half a lease: refreshes that fail together lapse within a lease
        silent = [i for i, t in self._expires_at.items() if t <= now + longest / 2]
        if len(self._records) < 2 or 2 * len(silent) <= len(self._records):
            self._mass_since = None
            return False
        if self._mass_since is None:
            self._mass_since = now
            log.warning(
                "most instances' leases lapsed at once; holding them, likelier an outage than their deaths",
                lapsed=len(silent),
                of=len(self._records),
            )
        return now - self._mass_since < MASS_EXPIRY_HOLD_LEASES * longest

    async def _bucket_takes_writes(self) -> bool:
        """Whether the bucket commits a write now (a key of this watcher's own). A read alone could
        come from a server that led the bucket until a partition cut it off and does not know it
        yet: its stale records would look expired. A committed write proves a quorum behind it."""
        try:
            assert self._kv is not None
            await asyncio.wait_for(self._kv.put(self._probe_key, b""), LEASE_CHECK_TIMEOUT_S)
        except Exception as exc:  # a timeout, no quorum, no responders
            self._hold(exc)
            return False
        return True

    def _hold(self, exc: Exception) -> None:
        if not self._holding:
            log.warning(
                "the discovery bucket does not answer; holding instances whose lease ran out until it does",
                error=f"{type(exc).__name__}: {exc}",
            )
        self._holding = True

    async def _expire_unless_refreshed(self, instance_id: int) -> bool:
        """Drop an instance whose lease ran out only on the bucket's word. The watch may have missed
        its refresh (after a NATS failover its consumer is made again), and a bucket that does not
        answer (its stream electing a new leader, several seconds on a cluster) is no evidence that
        the instance died: its instances are held until the bucket answers. False while it does not."""
        record = self._records.get(instance_id)
        if record is None:
            return True
        try:
            written_at = await asyncio.wait_for(self._last_written(record.key), LEASE_CHECK_TIMEOUT_S)
        except Exception as exc:  # a timeout, no responders: the bucket cannot say
            self._hold(exc)
            return False
        if self._holding:
            # Nobody could refresh while it did not answer: give every live instance the time its
            # refresh loop takes to retry (a timed-out attempt, the pause, a new one) before any is dropped.
            log.info("the discovery bucket answers again")
            self._holding = False
            self._grace_until = time.time() + REFRESH_TIMEOUT_S + RETRY_AFTER_FAILED_REFRESH_S + 0.5
        if written_at is not None and written_at + record.lease_ttl > time.time():
            self._expires_at[instance_id] = written_at + record.lease_ttl  # refreshed; the watch missed it
        elif time.time() < self._grace_until:
            return True  # asked again next round
        else:
            await self._remove(instance_id, reason="lease expired")
        return True

    async def _catch_up(self) -> None:
        """Take from the bucket any live record the watch never delivered. The watch's consumer can
        lose messages (its stream changing leader, the consumer made again at the wrong place); a
        missed refresh is caught by the lease check, a missed delete by the lease, but a missed first
        record would keep an instance out of the view for ever. One listing of keys per round; a
        bucket that does not answer is asked next round."""
        try:
            present = await asyncio.wait_for(self._present_keys(), LEASE_CHECK_TIMEOUT_S)
            for key in sorted(present):
                instance_id = _instance_id_from_key(key)
                if instance_id is None or instance_id in self._records:
                    continue
                live = await asyncio.wait_for(self._live_record(key), LEASE_CHECK_TIMEOUT_S)
                if live is None or instance_id in self._records:
                    continue  # deleted, or the watch delivered it meanwhile
                record, written_at = InstanceRecord.decode(live[0]), live[1]
                if written_at + record.lease_ttl > time.time():
                    log.warning("the watch missed an instance's record; taken from the bucket", key=key)
                    await self._upsert(record, written_at)
        except Exception as exc:  # a timeout, no responders, a malformed record: next round
            log.debug("could not compare the view with the bucket", error=f"{type(exc).__name__}: {exc}")

    async def _live_record(self, key: str) -> tuple[bytes, float] | None:
        """The live record of ``key`` (undecoded) and when it was last written (server time); None if
        it is gone."""
        entry = await latest_entry(self._js, names.INSTANCES_BUCKET, key)
        if entry is None or entry.value is None or entry.written_at is None:
            return None
        return entry.value, entry.written_at

    async def _last_written(self, key: str) -> float | None:
        """When the live record of ``key`` was last written (server time); None if it is gone."""
        live = await self._live_record(key)
        return None if live is None else live[1]


async def registered_now(js: JetStreamContext, namespace: str, component: str) -> list[InstanceRecord]:
    """The instances of ``component`` registered in ``namespace`` right now, as a fresh watcher lists
    them (for one look; a service that follows changes keeps a :class:`DiscoveryWatcher`)."""
    watcher = DiscoveryWatcher(js, namespace, component)
    await watcher.start()
    try:
        return watcher.instances()
    finally:
        await watcher.stop()


def _instance_id_from_key(key: str) -> int | None:
    try:
        return int(key.rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return None


async def _call(callback: InstanceCallback | None, record: InstanceRecord) -> None:
    if callback is None:
        return
    try:
        result = callback(record)
        if asyncio.iscoroutine(result):
            await result
    except Exception as exc:  # a failing listener must not stop the watch loop
        log.error("discovery callback failed", key=record.key, error=f"{type(exc).__name__}: {exc}")
