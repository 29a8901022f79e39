"""The router's side of the indexer's queries: ask one replica, fail over to the next.

Queries go over one ``FindMatchesMany`` stream per replica (:mod:`kvmesh.common.rpc.query_streams`)
rather than a unary call each (docs/decisions/0024).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

import structlog

from kvmesh.common.core.index_answer import EMPTY_ANSWER, IndexAnswer
from kvmesh.common.proto.kvmesh.v1 import common_pb2, indexer_pb2, indexer_pb2_grpc
from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.rpc.query_streams import QueryKind, QueryStreamBroken, QueryStreams
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.wire.worker_key import WorkerKey

log = structlog.get_logger(__name__)


class QueryRefusedByIndexer(ValueError):
    """The replica answered that it will not answer this query (too long)."""


def _response_of(answer: indexer_pb2.FindMatchesAnswer) -> indexer_pb2.FindMatchesResponse:
    if answer.refused:
        raise QueryRefusedByIndexer(answer.refused)
    return answer.response


INDEXER_QUERIES: QueryKind[indexer_pb2.FindMatchesRequest, indexer_pb2.FindMatchesResponse] = QueryKind(
    open=lambda channel: indexer_pb2_grpc.IndexerStub(channel).FindMatchesMany(),
    queries=indexer_pb2.FindMatchesQueries,
    response_of=_response_of,
)


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
        self._streams = QueryStreams(INDEXER_QUERIES, channels)
        self._clock = time.monotonic
        # what the router's misconfiguration checks read (kvmesh.router.fleet_checks)
        self.last_sizes: dict[WorkerKey, int] = {}  # the last answer's blocks per worker
        self.last_answer_at: float | None = None
        self.load_only_since: float | None = None  # no replica answered the queries since then

    def forget(self, address: str) -> None:
        """A replica left: close its stream (its queries in flight fail over)."""
        self._streams.forget(address)

    async def close(self) -> None:
        await self._streams.close()

    async def find_matches(
        self, block_hashes: Sequence[int], moe_query: Sequence[common_pb2.MoeExpert] = ()
    ) -> IndexAnswer:
        replicas = self._indexers.instances() if self._indexers else []
        self._rng.shuffle(replicas)
        query = indexer_pb2.FindMatchesRequest(sequence_hashes=block_hashes, moe_query=moe_query)
        for replica in replicas:
            try:
                response = await asyncio.wait_for(self._streams.ask(replica.address, query), self._timeout_s)
            except (QueryStreamBroken, QueryRefusedByIndexer, TimeoutError) as exc:
                reason = str(exc) or f"no answer within {self._timeout_s:g} s"
                log.warning("indexer replica did not answer", address=replica.address, reason=reason)
                continue
            self._answered()
            matched = {(w.worker_id, w.dp_rank): w.matched_blocks for w in response.workers}
            sizes = {(w.worker_id, w.dp_rank): w.total_blocks for w in response.workers}
            self.last_sizes = sizes
            moe = {
                (w.worker_id, w.dp_rank): (w.moe_aligned_blocks, w.moe_hosted_experts)
                for w in response.workers
                if w.moe_aligned_blocks or w.moe_hosted_experts
            }
            pooled = {(w.worker_id, w.dp_rank): w.pooled_blocks for w in response.workers if w.pooled_blocks}
            host = {(w.worker_id, w.dp_rank): w.host_blocks for w in response.workers if w.host_blocks}
            disk = {(w.worker_id, w.dp_rank): w.disk_blocks for w in response.workers if w.disk_blocks}
            return IndexAnswer(matched, sizes, moe, pooled, host, disk)
        if self.load_only_since is None:  # said once, until a replica answers again
            self.load_only_since = self._clock()
            log.warning("no indexer answered; routing on load alone until one does", replicas=len(replicas))
        return EMPTY_ANSWER

    def _answered(self) -> None:
        self.last_answer_at = self._clock()
        if self.load_only_since is not None:
            log.info("an indexer answers again; routing on cached overlap again")
            self.load_only_since = None
