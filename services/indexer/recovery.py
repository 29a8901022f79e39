"""Gap recovery: when the index finds a hole in a worker's event ids, ask that worker for its state.

The worker answers ``Worker.DumpKvState`` with every cached block and the last event id that state
reflects; :meth:`PrefixIndex.replace_worker` rebuilds the worker's part from it and applies the
events held back since the gap. A worker that cannot be reached is retried until it answers or
leaves discovery (which removes it from the index anyway).
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from kvmesh.common.core.prefix_index import DumpedBlock, PrefixIndex
from kvmesh.common.proto.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.common.rpc.grpc_server import channel_to
from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.wire.worker_key import IndexKey, TierKey

log = structlog.get_logger(__name__)


class GapRecovery:
    """Starts one recovery task per worker in ``index.gaps_pending``; call :meth:`poke` after applying."""

    def __init__(self, index: PrefixIndex, workers: DiscoveryWatcher, timeout_s: float = 5.0) -> None:
        self._index = index
        self._workers = workers
        self._timeout = timeout_s
        self._tasks: dict[IndexKey, asyncio.Task[None]] = {}

    def poke(self, _sequence: int | None = None) -> None:
        for key in self._index.gaps_pending:
            if key not in self._tasks:
                self._tasks[key] = asyncio.create_task(self._recover(key), name=f"recover-{key[0]}")

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks.values())

    async def _recover(self, key: IndexKey) -> None:
        delay = 0.1
        try:
            while key in self._index.gaps_pending:
                record = self._workers.get(key[0])
                if record is None:
                    if self._index.is_removed(key[0]):
                        return
                    await asyncio.sleep(delay)  # not registered (yet): discovery decides its fate
                    delay = min(delay * 2, 2.0)
                    continue
                admission = self._index.admission(key[0])
                try:
                    dump = await self._dump(record.address, key)
                except grpc.aio.AioRpcError as exc:
                    log.warning("worker dump failed; retrying", worker_id=key[0], code=exc.code().name)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                blocks = [
                    DumpedBlock(
                        b.block_hash,
                        b.tokens_hash,
                        b.parent_hash if b.HasField("parent_hash") else None,
                        b.sequence_hash if b.HasField("sequence_hash") else None,
                    )
                    for b in dump.blocks
                ]
                if not self._index.replace_worker(key, dump.last_event_id, blocks, admission):
                    # removed and back while we asked: events between this dump and its return were
                    # ignored, so only a dump asked for since then holds them (the loop asks again)
                    log.info("a worker's dump was outdated by its removal and return; asking again", worker_id=key[0])
                    continue
                log.info(
                    "recovered a worker after a gap",
                    worker_id=key[0],
                    blocks=len(blocks),
                    as_of_event=dump.last_event_id,
                )
        finally:
            self._tasks.pop(key, None)
            self.poke()  # a new gap may have appeared while we worked

    async def _dump(self, address: str, key: IndexKey) -> worker_pb2.KvStateDump:
        """The worker's own state of the stream ``key`` (a rank's cache, or a tier of it)."""
        request = worker_pb2.DumpKvStateRequest(dp_rank=key[1])
        if isinstance(key, TierKey):
            request.tier = key.tier
        async with channel_to(address) as channel:
            return await worker_pb2_grpc.WorkerStub(channel).DumpKvState(request, timeout=self._timeout)
