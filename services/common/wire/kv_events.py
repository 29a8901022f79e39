"""KV event wire format (DESIGN §3): one msgpack map per message, a batch of one worker's events.

    {v: 2, worker_id, dp_rank, tier, ts, events: [{event_id, tier, data}, ...]}

with ``data`` one of ``{type: "stored", parent_hash, blocks: [{block_hash, tokens_hash, num_tokens}]}``,
``{type: "removed", block_hashes: [...]}`` or ``{type: "cleared"}``. ``block_hash`` is the engine's
own opaque id (used for parent links and removals); ``tokens_hash`` is our local hash (used for
matching). ``event_id`` increases by one per (worker, dp_rank, tier): each storage tier of an engine
instance publishes a stream of its own (its device cache, its host-memory and disk tiers, its KV
pool segment), named by the batch's ``tier``; an event's own ``tier`` is its block's state within
that stream (a pool's ``in_transit`` copies).

Version 1 (no ``v``) named a tier by a reserved dp rank instead (0xFFFF the pool, 0xFFFE host,
0xFFFD disk, all of rank 0): it is still read, as that tier of rank 0.

A stored block of a mixture-of-experts model may carry ``moe: [[layer, expert, group], ...]``, the
expert placement it was computed with (DESIGN §7); blocks without it are encoded exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

DEVICE_TIER = "device"
POOLED_TIER = "pooled"
# A worker's offloaded copies (vLLM's CPU and disk media; the mock engine's host tier): each tier of
# a worker publishes as a dp rank of its own (its own event ids), as a pool segment does.
HOST_TIER = "host"
DISK_TIER = "disk"
# A block being copied into a pool: announced, not readable yet (DESIGN §7's block tiers). A store
# of another tier settles it; a removal of this tier abandons the copy.
IN_TRANSIT_TIER = "in_transit"
# What the index keeps of a block a pool dropped: its metadata, no longer a match (never on the wire).
EVICTED_TIER = "evicted"
# The storage tiers a stream of events can describe: an engine's own cache, its offloaded copies, and
# a worker's KV pool segment. The device is the default (its streams were the only ones at first).
STORAGE_TIERS = (DEVICE_TIER, HOST_TIER, DISK_TIER, POOLED_TIER)
OFFLOADED_TIERS = (HOST_TIER, DISK_TIER)
WIRE_VERSION = 2
# version 1 named a tier by a reserved dp rank (of rank 0)
_V1_RANK_TIERS = {0xFFFF: POOLED_TIER, 0xFFFE: HOST_TIER, 0xFFFD: DISK_TIER}


def stream_of_v1_rank(dp_rank: int) -> tuple[int, str]:
    """A version 1 dp rank as (dp rank, storage tier): a reserved rank named a tier of rank 0
    (batches, snapshots and dump requests written before version 2 are read with it)."""
    tier = _V1_RANK_TIERS.get(dp_rank)
    return (0, tier) if tier is not None else (dp_rank, DEVICE_TIER)


class EventDecodeError(ValueError):
    """A message on the event stream is not a valid KV event batch."""


MoePlacement = tuple[int, int, int]  # (layer, expert, group) an expert-parallel block was computed with


@dataclass(frozen=True, slots=True)
class StoredBlock:
    block_hash: int
    tokens_hash: int
    num_tokens: int
    moe: tuple[MoePlacement, ...] = ()


@dataclass(frozen=True, slots=True)
class BlocksStored:
    parent_hash: int | None
    blocks: tuple[StoredBlock, ...]


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


EventData = BlocksStored | BlocksRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEvent:
    event_id: int
    data: EventData
    tier: str = DEVICE_TIER


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """Consecutive events of one (worker, dp_rank, tier), as carried by one stream message."""

    worker_id: int
    dp_rank: int
    ts: float
    events: tuple[KvEvent, ...] = field(default_factory=tuple)
    tier: str = DEVICE_TIER  # the storage tier whose stream these events are

    @property
    def first_event_id(self) -> int:
        return self.events[0].event_id if self.events else -1


def _data_to_wire(data: EventData) -> dict[str, Any]:
    if isinstance(data, BlocksStored):
        return {
            "type": "stored",
            "parent_hash": data.parent_hash,
            "blocks": [_block_to_wire(b) for b in data.blocks],
        }
    if isinstance(data, BlocksRemoved):
        return {"type": "removed", "block_hashes": list(data.block_hashes)}
    return {"type": "cleared"}


def _block_to_wire(block: StoredBlock) -> dict[str, Any]:
    wire: dict[str, Any] = {
        "block_hash": block.block_hash,
        "tokens_hash": block.tokens_hash,
        "num_tokens": block.num_tokens,
    }
    if block.moe:
        wire["moe"] = [list(placement) for placement in block.moe]
    return wire


def _block_from_wire(raw: dict[str, Any]) -> StoredBlock:
    moe = raw.get("moe")
    placements = () if not moe else tuple(_placement(p) for p in moe)
    return StoredBlock(int(raw["block_hash"]), int(raw["tokens_hash"]), int(raw["num_tokens"]), placements)


def _placement(raw: Any) -> MoePlacement:
    layer, expert, group = (int(part) for part in raw)
    if min(layer, expert, group) < 0:
        raise EventDecodeError(f"negative MoE placement {raw!r}")
    return layer, expert, group


def parse_moe_placements(text: str) -> tuple[MoePlacement, ...]:
    """``"0:3:0,1:7:1"`` (layer:expert:group, comma-separated; group defaults to 0) as placements."""
    placements = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        if len(fields) not in (2, 3) or not all(f.isdigit() for f in fields):
            raise ValueError(f"bad MoE placement {item!r}: expected layer:expert[:group] (non-negative integers)")
        layer, expert, group = (int(fields[0]), int(fields[1]), int(fields[2]) if len(fields) == 3 else 0)
        placements.append((layer, expert, group))
    return tuple(placements)


def _data_from_wire(raw: dict[str, Any]) -> EventData:
    kind = raw.get("type")
    if kind == "stored":
        blocks = tuple(_block_from_wire(b) for b in raw["blocks"])
        parent = raw.get("parent_hash")
        return BlocksStored(None if parent is None else int(parent), blocks)
    if kind == "removed":
        return BlocksRemoved(tuple(int(h) for h in raw["block_hashes"]))
    if kind == "cleared":
        return AllBlocksCleared()
    raise EventDecodeError(f"unknown KV event type {kind!r}")


def encode_batch(batch: KvEventBatch) -> bytes:
    return msgpack.packb(
        {
            "v": WIRE_VERSION,
            "worker_id": batch.worker_id,
            "dp_rank": batch.dp_rank,
            "tier": batch.tier,
            "ts": batch.ts,
            "events": [{"event_id": e.event_id, "tier": e.tier, "data": _data_to_wire(e.data)} for e in batch.events],
        }
    )


def decode_batch(payload: bytes) -> KvEventBatch:
    """Decode one stream message; raises :class:`EventDecodeError` on anything malformed."""
    try:
        raw = msgpack.unpackb(payload)
        dp_rank = int(raw.get("dp_rank", 0))
        version = int(raw.get("v", 1))
        if version == 1:
            dp_rank, tier = stream_of_v1_rank(dp_rank)
        elif version == WIRE_VERSION:
            tier = str(raw.get("tier", DEVICE_TIER))
            if tier not in STORAGE_TIERS:
                raise EventDecodeError(f"unknown storage tier {tier!r}")
        else:
            raise EventDecodeError(f"KV event batch version {version} is newer than this reader's {WIRE_VERSION}")
        return KvEventBatch(
            worker_id=int(raw["worker_id"]),
            dp_rank=dp_rank,
            ts=float(raw.get("ts", 0.0)),
            events=tuple(
                KvEvent(int(e["event_id"]), _data_from_wire(e["data"]), str(e.get("tier", DEVICE_TIER)))
                for e in raw["events"]
            ),
            tier=tier,
        )
    except EventDecodeError:
        raise
    except Exception as exc:
        # Anything the bytes make the decoder do wrong (a wrong type, a missing key, an infinite
        # number, a truncated document...) means the same: this message is malformed. Fuzzing found
        # AttributeError and OverflowError escaping a narrower list, which would stop a replica.
        raise EventDecodeError(f"malformed KV event batch: {type(exc).__name__}: {exc}") from exc
