"""Index snapshots in the JetStream object store, taken by one replica at a time (DESIGN §4).

A snapshot is the whole index as of one stream sequence: for each worker its last applied event id
and its engine-id → sequence-hash map, as two packed uint64 arrays (16 bytes a block), plus the
workers that have left. It is stored under ``<namespace>/index`` in ``KVMESH_INDEX_SNAPSHOTS``.

Taking one (when the stream holds more than the threshold of this namespace's events):

1. take the lock ``<namespace>.index-snapshot`` in the KV bucket ``KVMESH_LOCKS`` (``snapshot_lock``; a key with a
   lease: the bucket's max age), so one replica works at a time;
2. upload, unless the stored snapshot is already as new;
3. purge this namespace's events below ``min(snapshot sequence, the ack floor of every durable
   consumer following them) + 1``: only messages that every replica of the namespace has
   acknowledged *and* that the snapshot covers go. Other namespaces sharing the stream keep theirs:
   their replicas count, snapshot and purge their own subjects. No purge while the server cannot
   list every durable (``purge.py``): one it cannot reach has an unknown floor;
4. release the lock.

A new replica holds the same lock from its read of the snapshot until its durable consumer exists:
that durable's ack floor then keeps the purge at or below the snapshot it read.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType

from kvmesh.common.core.prefix_index import UNKNOWN_PARENT, PrefixIndex
from kvmesh.common.runtime.jetstream_state import ensure_object_store
from kvmesh.common.wire import names
from kvmesh.common.wire.kv_events import DEVICE_TIER, stream_of_v1_rank
from kvmesh.common.wire.worker_key import IndexKey, TierKey, index_key
from kvmesh.indexer.metrics import IndexerState
from kvmesh.indexer.purge import purge_covered
from kvmesh.indexer.snapshot_lock import SnapshotLock

log = structlog.get_logger(__name__)

SNAPSHOT_FORMAT = 2
# How a block's parent is stored: none (a root), the entry before it, unknown, or listed apart.
_NO_PARENT, _PREVIOUS, _UNKNOWN, _EXPLICIT = 0, 1, 2, 3
_NOT_PREVIOUS = re.compile(rb"[\x00\x02\x03]")


class SnapshotError(ValueError):
    """A stored snapshot cannot be read (unknown format or corrupt)."""


@dataclass
class Snapshot:
    """The index as of ``stream_sequence``: per stream (a worker's device cache by its
    (worker id, dp rank), an offloaded tier or pool segment by its :class:`TierKey`), its last event
    id, engine id -> sequence hash and sequence hash -> parent's sequence hash."""

    stream_sequence: int
    # per stream: its key, last event id, blocks (engine id -> sequence hash) and parents
    workers: list[tuple[IndexKey, int, dict[int, int], dict[int, int | None]]] = field(default_factory=list)
    removed_workers: list[int] = field(default_factory=list)
    created: float = 0.0
    # per stream with MoE metadata: sequence hash -> (layer, expert, group) placements
    moe: dict[IndexKey, dict[int, tuple[tuple[int, int, int], ...]]] = field(default_factory=dict)
    # per stream whose blocks have states beyond resident: (resident tier, engine id -> sequence
    # hash of blocks in transit, the same of evicted blocks whose metadata is kept)
    tiers: dict[IndexKey, tuple[str, dict[int, int], dict[int, int]]] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return sum(len(w[3]) for w in self.workers)


def _u64(values: list[int]) -> bytes:
    packed = array("Q", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _from_u64(data: bytes) -> array:
    values = array("Q")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values


def capture(index: PrefixIndex, stream_sequence: int) -> Snapshot:
    workers = []
    for key in index.workers():
        last_event_id, by_engine_id, parent_of = index.export_worker(key)
        workers.append((key, last_event_id, by_engine_id, parent_of))
    moe = {key: tags for key in index.workers() if (tags := index.export_moe(key))}
    tiers = {}
    for key in index.workers():
        tier, in_transit, evicted = index.export_tiers(key)
        if tier != DEVICE_TIER or in_transit or evicted:
            tiers[key] = (tier, in_transit, evicted)
    return Snapshot(stream_sequence, workers, index.removed_workers(), time.time(), moe, tiers)


def _key_fields(key: IndexKey) -> dict:
    """A stream's key as a snapshot names it: its worker, rank and storage tier."""
    return {"worker_id": key[0], "dp_rank": key[1], "storage": key.tier if isinstance(key, TierKey) else DEVICE_TIER}


def _key_of(fields: dict) -> IndexKey:
    """The key a snapshot names; one written before tiers were a field names a tier by a reserved rank."""
    if "storage" in fields:
        return index_key(int(fields["worker_id"]), int(fields["dp_rank"]), str(fields["storage"]))
    dp_rank, tier = stream_of_v1_rank(int(fields["dp_rank"]))
    return index_key(int(fields["worker_id"]), dp_rank, tier)


def _encode_worker(key: IndexKey, last_event_id: int, blocks: dict[int, int], parent_of: dict[int, int | None]) -> dict:
    # Blocks are exported in the order they were stored, chain by chain, so a block's parent is
    # nearly always the entry before it: that costs one kind byte; other parents are listed apart.
    seqs = list(blocks.values())
    kinds = bytearray(len(seqs))
    explicit: list[int] = []
    previous = None
    for i, seq in enumerate(seqs):
        parent = parent_of.get(seq, UNKNOWN_PARENT)
        if parent is None:
            kinds[i] = _NO_PARENT
        elif parent == UNKNOWN_PARENT:
            kinds[i] = _UNKNOWN
        elif parent == previous:
            kinds[i] = _PREVIOUS
        else:
            kinds[i] = _EXPLICIT
            explicit.append(parent)
        previous = seq
    return {
        **_key_fields(key),
        "last_event_id": last_event_id,
        "engine_ids": _u64(list(blocks.keys())),
        "sequence_hashes": _u64(seqs),
        "parent_kinds": bytes(kinds),
        "explicit_parents": _u64(explicit),
    }


def encode(snapshot: Snapshot) -> bytes:
    return msgpack.packb(
        {
            "format": SNAPSHOT_FORMAT,
            "stream_sequence": snapshot.stream_sequence,
            "created": snapshot.created,
            "removed_workers": snapshot.removed_workers,
            "workers": [_encode_worker(*worker) for worker in snapshot.workers],
            # absent for a dense fleet; a reader that predates it ignores the key
            "moe": [
                {
                    **_key_fields(key),
                    "sequence_hashes": _u64(list(tags)),
                    "placements": list(tags.values()),
                }
                for key, tags in snapshot.moe.items()
            ],
            # absent unless a worker publishes pool tiers; a reader that predates it ignores the key
            "tiers": [
                {
                    **_key_fields(key),
                    "tier": tier,
                    "in_transit": [_u64(list(in_transit)), _u64(list(in_transit.values()))],
                    "evicted": [_u64(list(evicted)), _u64(list(evicted.values()))],
                }
                for key, (tier, in_transit, evicted) in snapshot.tiers.items()
            ],
        }
    )


def _decode_worker(w: dict) -> tuple[IndexKey, int, dict[int, int], dict[int, int | None]]:
    seqs = _from_u64(w["sequence_hashes"])
    kinds = w["parent_kinds"]
    # Assume every parent is the previous entry (built in C), then patch the others.
    parents: dict[int, int | None] = dict(zip(seqs[1:], seqs[:-1], strict=True))
    explicit = iter(_from_u64(w["explicit_parents"]))
    for match in _NOT_PREVIOUS.finditer(kinds):
        kind = match.group()[0]
        seq = seqs[match.start()]
        parents[seq] = None if kind == _NO_PARENT else UNKNOWN_PARENT if kind == _UNKNOWN else next(explicit)
    return (
        _key_of(w),
        int(w["last_event_id"]),
        dict(zip(_from_u64(w["engine_ids"]), seqs, strict=True)),
        parents,
    )


def decode(payload: bytes) -> Snapshot:
    try:
        raw = msgpack.unpackb(payload)
        if raw.get("format") != SNAPSHOT_FORMAT:
            raise SnapshotError(f"unknown snapshot format {raw.get('format')!r}")
        workers = [_decode_worker(w) for w in raw["workers"]]
        moe = {
            _key_of(m): {
                seq: tuple((int(a), int(b), int(c)) for a, b, c in placements)
                for seq, placements in zip(_from_u64(m["sequence_hashes"]), m["placements"], strict=True)
            }
            for m in raw.get("moe", [])
        }
        tiers = {
            _key_of(t): (
                str(t["tier"]),
                dict(zip(_from_u64(t["in_transit"][0]), _from_u64(t["in_transit"][1]), strict=True)),
                dict(zip(_from_u64(t["evicted"][0]), _from_u64(t["evicted"][1]), strict=True)),
            )
            for t in raw.get("tiers", [])
        }
        return Snapshot(
            int(raw["stream_sequence"]),
            workers,
            [int(w) for w in raw["removed_workers"]],
            float(raw.get("created", 0.0)),
            moe,
            tiers,
        )
    except SnapshotError:
        raise
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise SnapshotError(f"corrupt snapshot: {exc}") from exc


def restore(index: PrefixIndex, snapshot: Snapshot) -> None:
    for worker_id in snapshot.removed_workers:
        index.remove_worker(worker_id)
    for key, last_event_id, blocks, parent_of in snapshot.workers:
        index.import_worker(key, last_event_id, blocks, parent_of)
    for key, tags in snapshot.moe.items():
        index.import_moe(key, tags)
    for key, (tier, in_transit, evicted) in snapshot.tiers.items():
        index.import_tiers(key, tier, in_transit, evicted)


def snapshot_key(namespace: str) -> str:
    return f"{namespace}/index"


async def _object_store(js: JetStreamContext):
    return await ensure_object_store(
        js, ObjectStoreConfig(bucket=names.INDEX_SNAPSHOTS_BUCKET, storage=StorageType.FILE)
    )


# A read of the snapshot object gives up after this long and starts again. nats-py's object get waits
# for the chunks with no deadline; when another replica replaces the snapshot between the get's
# metadata read and its chunk read, the old chunks are purged and the get would wait forever (a CI
# run hung on exactly that). Reading again finds the new snapshot.
LOAD_ATTEMPT_TIMEOUT_S = 5.0
LOAD_ATTEMPTS = 4


async def load(js: JetStreamContext, namespace: str) -> Snapshot | None:
    """The stored snapshot of this namespace, or None if there is none. Never waits forever: a read
    raced by a replacement is retried; :class:`SnapshotError` after ``LOAD_ATTEMPTS`` stuck reads."""
    store = await _object_store(js)
    for attempt in range(1, LOAD_ATTEMPTS + 1):
        try:
            result = await asyncio.wait_for(store.get(snapshot_key(namespace)), LOAD_ATTEMPT_TIMEOUT_S)
        except nats.js.errors.ObjectNotFoundError:
            return None
        except TimeoutError:
            log.warning("snapshot read stalled (replaced while read?); reading again", attempt=attempt)
            continue
        return decode(result.data)
    raise SnapshotError(f"the snapshot could not be read in {LOAD_ATTEMPTS} attempts")


async def upload(js: JetStreamContext, namespace: str, snapshot: Snapshot) -> int:
    """Store ``snapshot`` unless the stored one is as new; returns the bytes written (0 if skipped)."""
    current = await load(js, namespace)
    if current is not None and current.stream_sequence >= snapshot.stream_sequence:
        return 0
    payload = encode(snapshot)
    store = await _object_store(js)
    await store.put(snapshot_key(namespace), payload)
    return len(payload)


class Snapshotter:
    """Checks the stream every ``interval_s``; past ``threshold`` of the namespace's messages, takes a
    snapshot and purges. Each check also reads how many of them ``durable`` has yet to deliver (the
    replica's lag).

    Skips while a worker is in gap recovery (its held-back events are not in the index yet).
    """

    def __init__(
        self,
        nc: NatsClient,
        namespace: str,
        owner: str,
        index: PrefixIndex,
        applied_sequence: Callable[[], int],
        state: IndexerState,
        threshold: int,
        interval_s: float = 5.0,
        durable: str | None = None,
    ) -> None:
        self._nc = nc
        js = nc.jetstream()
        self._js = js
        self._subject = names.kv_events_wildcard(namespace)
        self._durable = durable
        self._namespace = namespace
        self._lock = SnapshotLock(js, namespace, owner)
        self._index = index
        self._applied_sequence = applied_sequence
        self._state = state
        self.threshold = threshold
        self.interval_s = interval_s

    async def run_forever(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a NATS hiccup must not end the loop
                log.warning("snapshot check failed", error=str(exc))
            await asyncio.sleep(self.interval_s)

    async def check(self) -> bool:
        """One check; True when a snapshot was taken."""
        info = await self._js.stream_info(names.KV_EVENTS_STREAM, subjects_filter=self._subject)
        state = self._state
        state.stream_last_sequence = info.state.last_seq
        # the stream is shared by every namespace on the server: count this one's subjects only
        state.namespace_messages = sum((info.state.subjects or {}).values())
        if self._durable is not None:
            consumer = await self._js.consumer_info(names.KV_EVENTS_STREAM, self._durable)
            state.lag_messages = consumer.num_pending or 0
        if state.namespace_messages <= self.threshold or self._index.recovering:
            return False
        return await self.take()

    async def take(self) -> bool:
        if not await self._lock.acquire():
            return False  # another replica is at it
        try:
            started = time.perf_counter()
            snapshot = capture(self._index, self._applied_sequence())
            written = await upload(self._js, self._namespace, snapshot)
            purged_below = await purge_covered(self._nc, self._namespace, snapshot.stream_sequence)
            state = self._state
            state.last_snapshot_seconds = time.perf_counter() - started
            if written:
                state.snapshots_taken += 1
                state.last_snapshot_bytes = written
                state.snapshot_sequence = snapshot.stream_sequence
            state.last_purged_below = purged_below
            log.info(
                "snapshot taken",
                stream_sequence=snapshot.stream_sequence,
                blocks=snapshot.num_blocks,
                bytes=written,
                seconds=round(state.last_snapshot_seconds, 3),
                purged_below=purged_below,
            )
            return bool(written)
        finally:
            await self._lock.release()
