"""The router's side of the indexer's queries: ask one replica, fail over to the next.

Queries go over one ``FindMatchesMany`` stream per replica rather than a unary call each: in
grpc.aio a unary call costs the caller about five times the CPU of a stream message, and queries
asked while a message is being written share the next one (docs/decisions/0024).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import NamedTuple

import grpc
import structlog

from kvmesh.common.backlog import Backlog
from kvmesh.common.channels import ChannelPool
from kvmesh.common.discovery import DiscoveryWatcher
from kvmesh.common.proto.kvmesh.v1 import common_pb2, indexer_pb2, indexer_pb2_grpc
from kvmesh.common.runtime import cancel_and_wait
from kvmesh.common.worker_key import WorkerKey

log = structlog.get_logger(__name__)


class CacheView(NamedTuple):
    """What the caches hold for one request: matched prefix blocks and tree size per worker, and
    with a MoE query (aligned matched blocks, queried experts hosted) per worker that has any."""

    matched: dict[WorkerKey, int]
    tree_sizes: dict[WorkerKey, int]
    moe: dict[WorkerKey, tuple[int, int]] = {}
    pooled: dict[WorkerKey, int] = {}  # blocks past the match a worker can import from its KV pool


class QueryStreamBroken(ConnectionError):
    """The stream a query was asked on ended before its answer came."""


class QueryRefusedByIndexer(ValueError):
    """The replica answered that it will not answer this query (too long)."""


class _QueryStream:
    """One ``FindMatchesMany`` stream to one indexer replica. Guarantees: every query asked gets
    its answer, its refusal, or :class:`QueryStreamBroken` once the stream ends; once broken it
    takes no new query (:attr:`broken`). Queries asked while a write is in flight go together in
    the next message (grpc.aio allows one write in flight per call)."""

    def __init__(self, channel: grpc.aio.Channel, address: str) -> None:
        self.address = address
        self._call = indexer_pb2_grpc.IndexerStub(channel).FindMatchesMany()
        self._last_id = 0
        self._waiting: dict[int, asyncio.Future[indexer_pb2.FindMatchesResponse]] = {}
        self._unsent: Backlog[indexer_pb2.FindMatchesQuery] = Backlog()
        self.broken: QueryStreamBroken | None = None
        self._tasks = [
            asyncio.create_task(self._write_all(), name=f"indexer-queries-write-{address}"),
            asyncio.create_task(self._read_all(), name=f"indexer-queries-read-{address}"),
        ]

    def ask(self, request: indexer_pb2.FindMatchesRequest) -> asyncio.Future[indexer_pb2.FindMatchesResponse]:
        """The answer's future. Cancelling it (a timeout) only drops the answer when it comes."""
        if self.broken is not None:
            raise self.broken
        self._last_id += 1
        answer = asyncio.get_running_loop().create_future()
        self._waiting[self._last_id] = answer
        self._unsent.add(indexer_pb2.FindMatchesQuery(query_id=self._last_id, request=request))
        return answer

    async def _write_all(self) -> None:
        try:
            while True:
                queries = await self._unsent.take()
                await self._call.write(indexer_pb2.FindMatchesQueries(queries=queries))
        except Exception as exc:  # the call ended (AioRpcError, or InvalidStateError once cancelled)
            self._break(exc)

    async def _read_all(self) -> None:
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    self._break(None)
                    return
                for answer in message.answers:
                    waiting = self._waiting.pop(answer.query_id, None)
                    if waiting is None or waiting.done():
                        continue  # its asker gave up (timed out)
                    if answer.refused:
                        waiting.set_exception(QueryRefusedByIndexer(answer.refused))
                    else:
                        waiting.set_result(answer.response)
        except grpc.aio.AioRpcError as exc:
            self._break(exc)

    def _break(self, cause: BaseException | None) -> None:
        if self.broken is not None:
            return
        if isinstance(cause, grpc.aio.AioRpcError):
            cause_text = f"{cause.code().name}: {cause.details()}"
        else:
            cause_text = str(cause or "closed by the replica")
        self.broken = QueryStreamBroken(f"the query stream to {self.address} ended ({cause_text})")
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(self.broken)
        self._waiting.clear()

    async def close(self) -> None:
        self._call.cancel()
        await cancel_and_wait(*self._tasks)
        self._break(None)


class IndexerClient:
    """Queries indexer replicas in random order (spreading load) until one answers within the
    deadline. Guarantees an answer: with no replica answering, an empty view, so routing goes on
    load alone instead of failing the request."""

    def __init__(
        self, indexers: DiscoveryWatcher | None, channels: ChannelPool, timeout_s: float, rng: random.Random
    ) -> None:
        self._indexers = indexers
        self._channels = channels
        self._timeout_s = timeout_s
        self._rng = rng
        self._streams: dict[str, _QueryStream] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def _stream_to(self, address: str) -> _QueryStream:
        stream = self._streams.get(address)
        if stream is None or stream.broken is not None:
            if stream is not None:
                self._close_later(stream)
            stream = self._streams[address] = _QueryStream(self._channels.get(address), address)
        return stream

    def forget(self, address: str) -> None:
        """A replica left: close its stream (its queries in flight fail over)."""
        stream = self._streams.pop(address, None)
        if stream is not None:
            self._close_later(stream)

    def _close_later(self, stream: _QueryStream) -> None:
        task = asyncio.create_task(stream.close(), name=f"close-indexer-queries-{stream.address}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        await cancel_and_wait(*self._closing)
        for stream in streams:
            await stream.close()

    async def find_matches(
        self, block_hashes: Sequence[int], moe_query: Sequence[common_pb2.MoeExpert] = ()
    ) -> CacheView:
        replicas = self._indexers.instances() if self._indexers else []
        self._rng.shuffle(replicas)
        query = indexer_pb2.FindMatchesRequest(sequence_hashes=block_hashes, moe_query=moe_query)
        for replica in replicas:
            try:
                response = await asyncio.wait_for(self._stream_to(replica.address).ask(query), self._timeout_s)
            except (QueryStreamBroken, QueryRefusedByIndexer, TimeoutError) as exc:
                reason = str(exc) or f"no answer within {self._timeout_s:g} s"
                log.warning("indexer replica did not answer", address=replica.address, reason=reason)
                continue
            matched = {(w.worker_id, w.dp_rank): w.matched_blocks for w in response.workers}
            sizes = {(w.worker_id, w.dp_rank): w.total_blocks for w in response.workers}
            moe = {
                (w.worker_id, w.dp_rank): (w.moe_aligned_blocks, w.moe_hosted_experts)
                for w in response.workers
                if w.moe_aligned_blocks or w.moe_hosted_experts
            }
            pooled = {(w.worker_id, w.dp_rank): w.pooled_blocks for w in response.workers if w.pooled_blocks}
            return CacheView(matched, sizes, moe, pooled)
        log.warning("no indexer answered; routing on load alone")
        return CacheView({}, {})
