"""The lease lock one indexer replica holds while it takes a snapshot or reads one (DESIGN §4).

The lock is the key ``<namespace>.index-snapshot`` in the KV bucket ``KVMESH_LOCKS``: held by whoever
created it, released by deleting it, and lapsing with the bucket's max age (``LOCK_LEASE_S``) where
its holder died holding it.
"""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from kvmesh.common.runtime.jetstream_state import ensure_key_value, latest_entry, when_jetstream_answers
from kvmesh.common.wire import names

log = structlog.get_logger(__name__)

LOCK_LEASE_S = 30.0


class Unsettled(nats.errors.TimeoutError):
    """The lock's key is free by its stream leader's store, yet a write to it was refused: JetStream
    has not settled it yet. A timeout to ``when_jetstream_answers``, which asks again."""


async def _locks(js: JetStreamContext) -> KeyValue:
    return await ensure_key_value(js, KeyValueConfig(bucket=names.LOCKS_BUCKET, history=1, ttl=LOCK_LEASE_S))


class SnapshotLock:
    """A lease lock on a KV key. Guarantees: :meth:`acquire` is True only when this owner's value is
    the key's latest as the bucket's stream leader has it; :meth:`release` deletes only this owner's."""

    def __init__(self, js: JetStreamContext, namespace: str, owner: str) -> None:
        self._js = js
        self.key = f"{namespace}.index-snapshot"
        self.owner = owner
        self._kv: KeyValue | None = None
        self.held = False

    async def acquire(self) -> bool:
        """True when this owner now holds the lock, False while another does. Waits while JetStream
        does not answer (see ``when_jetstream_answers``)."""
        self._kv = await _locks(self._js)
        # The bucket's stream answers nothing until its servers elect a leader: on a cluster, a create
        # right after the bucket was made met "no responders" in CI.
        self.held = await when_jetstream_answers(self._take, f"lock {self.key}")
        return self.held

    async def _take(self) -> bool:
        kv = self._kv
        assert kv is not None
        try:
            await kv.create(self.key, self.owner.encode())
            return True
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError):
            pass
        # Refused. nats-py tells a deleted key from a held one by a direct read, which any replica may
        # answer, and one that lags (just restarted) still showed the deleted key's old value: the
        # lock was free and nobody could take it. So the stream's leader decides (latest_entry). A create that
        # timed out before may also have been written, even after this read: then the key is ours.
        mine = self.owner.encode()
        revision, owner = await self._latest()
        if owner is not None:
            return owner == mine
        try:
            await kv.update(self.key, mine, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            # Free by the leader's store and still refused: another took it meanwhile, or a write is
            # pending there (a leader that lost its majority counts our timed-out create, which it
            # cannot yet commit, seen on a cluster). Asked again once the leader's state settles.
            raise Unsettled(self.key) from None
        return True

    async def _latest(self) -> tuple[int, bytes | None]:
        """The key's revision (0: never written, or aged out) and its holder's value (None: free), as
        the stream's leader has them."""
        entry = await latest_entry(self._js, names.LOCKS_BUCKET, self.key)
        return (0, None) if entry is None else (entry.revision, entry.value)

    async def wait_and_acquire(self, poll_s: float = 0.05) -> None:
        """Acquire, waiting while another holds it (a dead holder's lease lapses in ``LOCK_LEASE_S``)."""
        waited = False
        while not await self.acquire():
            if not waited:
                log.info("waiting for the replica taking a snapshot", lock=self.key)
                waited = True
            await asyncio.sleep(poll_s)

    async def release(self) -> None:
        """Delete the key if this owner still holds it; a no-op once released."""
        if self._kv is not None and self.held:
            self.held = False
            revision, owner = await self._latest()
            if owner == self.owner.encode():
                await self._kv.delete(self.key, last=revision)
