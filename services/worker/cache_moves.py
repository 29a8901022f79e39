"""A worker's cache kept when the fleet changes (docs/decisions/0051): a worker that is stopped hands
its hottest cached blocks on to the workers that stay, and a worker that joins first imports the
busiest workers' hottest blocks. The bytes move over the worker's KV transfer (TCP or NIXL) and are
checked on arrival; the blocks taken are cached as if computed, so the indexers see them through the
taker's ordinary KV events and the routers send their prefixes to the new holders.

Both ends speak ``kvmesh.v1.Worker``: ``OfferBlocks`` holds blocks in a transfer room for the caller,
``TakeBlocks`` has the callee pull an offer. A move that fails or runs out of time loses nothing but
the move: the offered blocks are released when their hold expires, the taker keeps what arrived whole.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import structlog

from kvmesh.common.calling.worker_caches import cached_hashes
from kvmesh.common.proto.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.common.rpc.grpc_server import channel_to
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.worker.engine import Engine
from kvmesh.worker.engines.mock.block_moves import Block, families
from kvmesh.worker.kv_transfer.handoff import KvTransfer
from kvmesh.worker.kv_transfer.transport import TransferError

log = structlog.get_logger(__name__)

# a hand-on's bound beyond the KV transfer's timeout: the survivors' cache reads and the gRPC calls
HAND_ON_SLACK_S = 10.0
# the longest a request waits for the prefix it was told to pull: a pull is worth its wait only while
# it is shorter than the prefill it saves, and the request then computes what did not arrive
PULL_BOUND_S = 2.0
# the workers to move blocks to or from, as discovery shows them when asked
Peers = Callable[[], Awaitable[Sequence[InstanceRecord]]]


@dataclass(frozen=True)
class Moved:
    """What one move brought: blocks cached by the taker, bytes pulled, seconds it took."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def __add__(self, other: Moved) -> Moved:
        return Moved(self.blocks + other.blocks, self.bytes + other.bytes, self.seconds + other.seconds)


def offer_message(worker_id: int, transfer: KvTransfer, room: int, blocks: Sequence[Block]) -> worker_pb2.BlockOffer:
    offered = []
    for sequence_hash, local_hash, parent in blocks:
        block = worker_pb2.OfferedBlock(sequence_hash=sequence_hash, tokens_hash=local_hash)
        if parent is not None:
            block.parent_hash = parent
        offered.append(block)
    return worker_pb2.BlockOffer(
        worker_id=worker_id, host=transfer.host, port=transfer.server.port, room=room, blocks=offered
    )


def blocks_of(offer: worker_pb2.BlockOffer) -> list[Block]:
    return [
        (b.sequence_hash, b.tokens_hash, b.parent_hash if b.HasField("parent_hash") else None) for b in offer.blocks
    ]


class CacheMoves:
    """Guarantees: an offer's blocks stay cached until taken or until the transfer's hold timeout;
    a take caches only blocks whose bytes arrived and checked, each after its parent."""

    def __init__(self, worker_id: int, engine: Engine, transfer: KvTransfer, timeout_s: float) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.transfer = transfer
        self.timeout_s = timeout_s
        self._ids = itertools.count()
        # for the worker's metrics: blocks this worker held for others to take, and took from others
        self.offered_blocks = 0
        self.taken_blocks = 0

    # ---- the two ends ------------------------------------------------------------------------
    def offer(self, blocks: Sequence[Block]) -> worker_pb2.BlockOffer:
        """Hold ``blocks`` (those still cached) in a new transfer room; the offer names them."""
        room = secrets.randbits(62)
        offer_id = f"offer-{room}"
        by_hash = {block[0]: block for block in blocks}
        held = self.engine.offer_blocks(offer_id, list(by_hash))
        if not held:
            return offer_message(self.worker_id, self.transfer, 0, [])
        self.transfer.server.ready(room, offer_id, [slot for _, slot in held])
        self.offered_blocks += len(held)
        return offer_message(self.worker_id, self.transfer, room, [by_hash[h] for h, _ in held])

    def offer_hottest(self, max_blocks: int, skip: set[int], hold: bool = True) -> worker_pb2.BlockOffer:
        """An offer of up to ``max_blocks`` of the hottest cached blocks the caller lacks (``hold``
        False: only their names, in no room)."""
        hot = [b for b in self.engine.hot_blocks(max_blocks + len(skip)) if b[0] not in skip][:max_blocks]
        return self.offer(hot) if hold else offer_message(self.worker_id, self.transfer, 0, hot)

    async def take(self, offer: worker_pb2.BlockOffer) -> Moved:
        """Pull ``offer``'s blocks (as many as fit) into this worker's cache."""
        blocks = blocks_of(offer)
        if not blocks or not offer.room:
            return Moved()
        intake_id = f"intake-{offer.worker_id}-{offer.room}-{next(self._ids)}"
        slots = self.engine.reserve_intake(intake_id, blocks)
        received = False
        started = time.perf_counter()
        try:
            result = await self.transfer.client.pull(
                offer.host, offer.port, offer.room, 0, slots, [b[0] for b in blocks[: len(slots)]], self.timeout_s
            )
            received = True
        except TransferError as exc:
            log.warning("cached blocks not taken", giver=offer.worker_id, error=str(exc))
            return Moved()
        finally:
            taken = self.engine.finish_intake(intake_id, received)
        seconds = time.perf_counter() - started
        self.taken_blocks += taken
        log.info(
            "cached blocks taken", giver=offer.worker_id, blocks=taken, offered=len(blocks), ms=round(seconds * 1e3)
        )
        return Moved(taken, result.bytes, seconds)

    # ---- a request told to pull its prefix (docs/decisions/0070) ------------------------------
    def offer_prefix(self, sequence_hashes: Sequence[int]) -> worker_pb2.BlockOffer:
        """An offer of these blocks of a prompt: those still cached, up to the first that is not."""
        return self.offer(self.engine.cached_prefix(list(sequence_hashes)))

    async def pull_prefix(self, holder: int, address: str, sequence_hashes: Sequence[int]) -> Moved:
        """Pull these blocks of a prompt from worker ``holder`` at ``address`` into this worker's cache,
        within :data:`PULL_BOUND_S` and the transfer's timeout. Never raises: a pull that fails or runs
        late keeps what arrived whole, and the request computes the rest."""
        request = worker_pb2.OfferBlocksRequest(sequence_hashes=sequence_hashes)
        try:
            async with asyncio.timeout(min(PULL_BOUND_S, self.timeout_s)):
                return await self.take(await asked_offer(address, request))
        except grpc.aio.AioRpcError as exc:
            log.warning("prefix not pulled", holder=holder, error=exc.details())
        except TimeoutError:
            log.warning("prefix pull cut short at its bound", holder=holder, bound_s=PULL_BOUND_S)
        return Moved()

    # ---- a worker that leaves ----------------------------------------------------------------
    async def hand_on(self, survivors: Peers, max_blocks: int) -> Moved:
        """Hand up to ``max_blocks`` of the hottest cached blocks on to the workers ``survivors``
        names: each prefix family goes whole to the survivor that holds most of it already (ties: the
        one given least), less what that survivor holds; every survivor pulls its share at once. All
        within the transfer's timeout and ``HAND_ON_SLACK_S``, discovery's answer too: a stop is never
        held longer; what has not moved by then leaves with this worker."""
        total, hot, records = Moved(), [], []
        try:
            async with asyncio.timeout(self.timeout_s + HAND_ON_SLACK_S):
                records = await survivors()
                hot = self.engine.hot_blocks(max_blocks)
                if hot and records:
                    total = await self._hand_on(hot, records)
        except TimeoutError:
            log.warning("hand-on cut short; the rest of the cache leaves with this worker")
        log.info("cache handed on", blocks=total.blocks, of_hot=len(hot), survivors=len(records))
        return total

    async def _hand_on(self, hot: list[Block], survivors: Sequence[InstanceRecord]) -> Moved:
        held = await asyncio.gather(*(cached_hashes(record) for record in survivors))
        shares: list[list[Block]] = [[] for _ in survivors]
        for family in families(hot):
            best = max(
                range(len(survivors)),
                key=lambda i: (sum(1 for b in family if b[0] in held[i]), -len(shares[i])),
            )
            shares[best].extend(b for b in family if b[0] not in held[best])
        calls = [self._give(record, share) for record, share in zip(survivors, shares, strict=True) if share]
        return sum(await asyncio.gather(*calls), Moved())

    async def _give(self, record: InstanceRecord, share: list[Block]) -> Moved:
        offer = self.offer(share)
        try:
            async with channel_to(record.address) as channel:
                reply = await worker_pb2_grpc.WorkerStub(channel).TakeBlocks(offer, timeout=self.timeout_s + 5)
        except grpc.aio.AioRpcError as exc:
            log.warning("a survivor did not take its share", worker=record.instance_id, error=exc.details())
            return Moved()
        return Moved(reply.blocks, reply.bytes, reply.seconds)

    # ---- a worker that joins -----------------------------------------------------------------
    async def warm_up(self, peers: Peers, max_blocks: int, max_secs: float) -> Moved:
        """Import up to ``max_blocks`` hot blocks, within ``max_secs`` (discovery's answer too: a join
        is never held longer), from the peers with at least their mean of requests in flight (their
        hottest prefixes have more demand than holders), busiest first, an equal share of each."""
        started = time.perf_counter()
        total = Moved()
        try:
            async with asyncio.timeout(max_secs):
                records = await peers()
                loads = await asyncio.gather(*(in_flight(record) for record in records))
                known = [(load, record) for load, record in zip(loads, records, strict=True) if load is not None]
                if not known:
                    return total
                mean = sum(load for load, _ in known) / len(known)
                busy = sorted((p for p in known if p[0] >= mean), key=lambda p: -p[0])
                share = max(1, max_blocks // len(busy))
                for _, record in busy:
                    total = total + await self._import_from(record, min(share, max_blocks - total.blocks))
                    if total.blocks >= max_blocks:
                        break
        except TimeoutError:
            log.info("warm-up stopped at its time bound", secs=max_secs)
        log.info("warmed up", blocks=total.blocks, bytes=total.bytes, ms=round((time.perf_counter() - started) * 1e3))
        return total

    async def _import_from(self, record: InstanceRecord, max_blocks: int) -> Moved:
        if max_blocks <= 0:
            return Moved()
        # what an earlier peer gave (a shared system prompt) is not offered again
        _, cached = self.engine.dump_kv_state()
        request = worker_pb2.OfferBlocksRequest(max_blocks=max_blocks, skip=[b.sequence_hash for b in cached])
        try:
            offer = await asked_offer(record.address, request, self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("a peer offered nothing", worker=record.instance_id, error=exc.details())
            return Moved()
        return await self.take(offer)


async def asked_offer(
    address: str, request: worker_pb2.OfferBlocksRequest, timeout_s: float | None = None
) -> worker_pb2.BlockOffer:
    """The offer the worker at ``address`` makes for ``request`` (its hottest blocks, or the prefix it
    names); gRPC's error where it makes none."""
    async with channel_to(address) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).OfferBlocks(request, timeout=timeout_s)


async def in_flight(record: InstanceRecord) -> int | None:
    """A worker's requests running and waiting (None: it did not answer)."""
    try:
        async with channel_to(record.address) as channel:
            status = await worker_pb2_grpc.WorkerStub(channel).GetStatus(worker_pb2.WorkerStatusRequest(), timeout=5)
    except grpc.aio.AioRpcError:
        return None
    return status.running_requests + status.waiting_requests
