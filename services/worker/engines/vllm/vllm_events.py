"""vLLM's KV cache events, relayed to JetStream in kvmesh's format (DESIGN §3, §7).

vLLM publishes ``KVEventBatch`` messages on a ZMQ PUB socket — frames ``(topic, seq as 8 bytes big
endian, msgpack payload)``, the payload ``[ts, [event, ...], data_parallel_rank]`` with each event a
map tagged by ``type`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) — and keeps the
recent batches for a ROUTER *replay* socket that resends from a sequence number.

:class:`VllmEventTranslator` (sans-I/O) turns those events into ours. Keys are computed by us from
the token ids a ``BlockStored`` carries (DESIGN §2); vLLM's own block hash is kept only as the
engine's block id, to link parents and apply its removals. It also keeps the set of blocks the
events describe, which ``DumpKvState`` answers from. :class:`VllmEventRelay` owns the sockets: it
binds the SUB socket the engine's publisher connects to, numbers batches by vLLM's sequence, and on
a gap asks the replay socket for what it missed before going on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import structlog

from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.wire.hashing import hash_block_tokens, lora_seed, next_sequence_hash
from kvmesh.common.wire.kv_events import (
    DEVICE_TIER,
    DISK_TIER,
    HOST_TIER,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    EventData,
    StoredBlock,
)
from kvmesh.worker.engine import CachedBlock

log = structlog.get_logger(__name__)

# vLLM's medium of blocks in the engine's own KV cache, and of its offloaded tiers (its offloading
# connectors name CPU memory and disk), each relayed as a tier of its own (DESIGN §7)
DEVICE_MEDIUMS = (None, "GPU")
MEDIUMS_BY_TIER = {DEVICE_TIER: DEVICE_MEDIUMS, HOST_TIER: ("CPU", "CPU_PINNED"), DISK_TIER: ("DISK", "LOCAL_DISK")}
_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def engine_block_id(block_hash: int | bytes) -> int:
    """vLLM's external block hash as our u64 engine block id."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[:8], "little")
    return block_hash & 0xFFFFFFFFFFFFFFFF


class VllmEventTranslator:
    """vLLM events in, kvmesh events out. Guarantees: :meth:`cached_blocks` is exactly the set of
    device blocks stored and not since removed or cleared, each with our tokens and sequence hash."""

    def __init__(self, mediums: Sequence[str | None] = DEVICE_MEDIUMS) -> None:
        """``mediums``: the vLLM media of the tier this translator follows (the device's by default);
        events of other media are skipped (another translator follows them)."""
        self._blocks: dict[int, CachedBlock] = {}
        self._mediums = tuple(mediums)
        self.skipped_events = 0

    def translate(self, events: Sequence[dict[str, Any]]) -> list[EventData]:
        out: list[EventData] = []
        for event in events:
            kind = event.get("type")
            if event.get("medium") not in self._mediums and not (
                kind == "AllBlocksCleared" and event.get("medium") is None
            ):
                self.skipped_events += 1  # another tier's (its own translator follows it)
            elif kind == "BlockStored":
                out.append(self._stored(event))
            elif kind == "BlockRemoved":
                removed = tuple(engine_block_id(h) for h in event["block_hashes"])
                for block_id in removed:
                    self._blocks.pop(block_id, None)
                out.append(BlocksRemoved(removed))
            elif kind == "AllBlocksCleared":
                self._blocks.clear()
                out.append(AllBlocksCleared())
            else:
                self.skipped_events += 1
        return out

    def _stored(self, event: dict[str, Any]) -> BlocksStored:
        block_size = int(event["block_size"])
        tokens = event["token_ids"]
        seed = lora_seed(event.get("lora_name"))
        raw_parent = event.get("parent_block_hash")
        parent = engine_block_id(raw_parent) if raw_parent is not None else None
        parent_block = self._blocks.get(parent) if parent is not None else None
        # an unknown parent (evicted meanwhile, or before the relay started) leaves the chain unknown
        chained = parent is None or parent_block is not None
        previous_sequence = parent_block.sequence_hash if parent_block is not None else None
        previous_id = parent
        stored = []
        for i, raw in enumerate(event["block_hashes"]):
            block_id = engine_block_id(raw)
            local = hash_block_tokens(tokens[i * block_size : (i + 1) * block_size], seed)
            sequence = local if previous_sequence is None else next_sequence_hash(previous_sequence, local)
            if chained:
                self._blocks[block_id] = CachedBlock(block_id, local, previous_id, sequence)
            stored.append(StoredBlock(block_id, local, block_size))
            previous_sequence, previous_id = sequence, block_id
        return BlocksStored(parent, tuple(stored))

    def cached_blocks(self) -> list[CachedBlock]:
        return list(self._blocks.values())

    def __len__(self) -> int:
        return len(self._blocks)


def decode_batch(payload: bytes) -> list[dict[str, Any]]:
    """The events of one vLLM ``KVEventBatch`` payload."""
    batch = msgpack.unpackb(payload, raw=False)
    if isinstance(batch, dict):  # a publisher configured for maps instead of arrays
        return list(batch.get("events", ()))
    return list(batch[1])


class VllmEventRelay:
    """Receives vLLM's event batches in sequence order and hands each batch's translated events to
    ``deliver``; recovers a gap from the replay socket (or, when the replay buffer no longer holds
    it, goes on and counts the loss — the indexer's own gap recovery then asks ``DumpKvState``)."""

    def __init__(
        self,
        sub_endpoint: str,
        replay_endpoint: str,
        translator: VllmEventTranslator,
        deliver: Callable[[list[EventData]], None],
        offloaded: dict[str, tuple[VllmEventTranslator, Callable[[list[EventData]], None]]] | None = None,
        connect: bool = False,
    ) -> None:
        """``offloaded``: per offloaded tier (``host``, ``disk``), its translator and where its events go.
        ``connect``: connect to ``sub_endpoint`` where the publisher binds it (an engine server
        configured with a wildcard endpoint), instead of binding it for the publisher."""
        import zmq.asyncio

        self._offloaded = offloaded or {}

        self.sub_endpoint = sub_endpoint
        self.replay_endpoint = replay_endpoint
        self.translator = translator
        self._deliver = deliver
        self._context = zmq.asyncio.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)
        if connect:
            self._sub.connect(sub_endpoint)
        else:
            # vLLM's publisher connects to an endpoint without a wildcard: we bind, it connects
            self._sub.bind(sub_endpoint)
        self._next_seq = 0
        self.batches = 0
        self.replayed = 0
        self.lost = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="vllm-kv-events")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._sub.close(linger=0)
        self._context.term()

    async def _run(self) -> None:
        while True:
            _topic, seq_bytes, payload = await self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self._next_seq:
                continue  # already delivered by a replay
            if seq > self._next_seq:
                await self._replay(self._next_seq, seq)
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
            self._deliver(self.translator.translate(events))
            for translator, deliver in self._offloaded.values():
                tiered = translator.translate(events)
                if tiered:
                    deliver(tiered)
        except Exception as exc:  # a malformed batch must not stop the relay
            log.warning("skipped an unreadable vLLM KV event batch", seq=seq, error=str(exc))
        self._next_seq = seq + 1
        self.batches += 1

    async def _replay(self, start: int, until: int) -> None:
        """Ask vLLM's replay socket for batches ``start`` … ``until - 1``."""
        import zmq

        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while self._next_seq < until and await dealer.poll(2000):
                frames = await dealer.recv_multipart()
                if len(frames) < 4 or frames[2] == _END_OF_REPLAY:
                    break
                seq = int.from_bytes(frames[2], "big")
                if start <= seq < until and seq >= self._next_seq:
                    if seq > self._next_seq:
                        self.lost += seq - self._next_seq
                    self._apply(seq, frames[3])
                    self.replayed += 1
        finally:
            dealer.close(linger=0)
        if self._next_seq < until:
            self.lost += until - self._next_seq
            log.warning("vLLM KV event batches lost (beyond the replay buffer)", first=self._next_seq, until=until)
            self._next_seq = until


Publisher = tuple[Callable[[list[EventData]], None], Callable[[], int]]  # where events go, the last id numbered


class OffloadedTiers:
    """One engine core's offloaded tiers (an offloading connector's CPU and disk blocks): per tier,
    a translator following that medium and the stream its events go to (the core's own rank and
    that tier: each rank's offloaded blocks are its own)."""

    def __init__(self, publishers: Mapping[str, Publisher] | None) -> None:
        self._publishers = dict(publishers or {})
        self._translators = {tier: VllmEventTranslator(MEDIUMS_BY_TIER[tier]) for tier in self._publishers}

    def relays(self) -> dict[str, tuple[VllmEventTranslator, Callable[[list[EventData]], None]]]:
        """What the core's event relay hands each tier's events to."""
        return {tier: (self._translators[tier], publish) for tier, (publish, _last) in self._publishers.items()}

    def dump(self, tier: str) -> tuple[int, list[CachedBlock]] | None:
        """The relay's view of the blocks the core offloaded to ``tier`` (None: it has no such tier)."""
        if tier not in self._publishers:
            return None
        return self._publishers[tier][1](), self._translators[tier].cached_blocks()
