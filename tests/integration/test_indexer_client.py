"""The router's IndexerClient over real gRPC: queries ride one FindMatchesMany stream per replica,
several to a message, each answered with its own result; a replica that stays silent past the
deadline, refuses, or dies with queries in flight is passed over for the next one."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.common.proto.kvmesh.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh.common.rpc.channels import ChannelPool
from kvmesh.common.rpc.grpc_server import GrpcService, start_grpc_server
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.router.indexer_client import IndexerClient
from tests.support import wait_until_async

pytestmark = pytest.mark.integration


class ScriptedIndexer(indexer_pb2_grpc.IndexerServicer):
    """An indexer peer for these tests. ``answer``: worker 1 matches every block of the query, so
    an answer shows which query it belongs to; ``silent``: reads and never answers; ``refuse``:
    refuses every query; ``hold``: answers only once :attr:`release` is set. Records how many
    queries each message carried."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.message_sizes: list[int] = []
        self.release = asyncio.Event()

    async def FindMatchesMany(
        self, request_iterator: AsyncIterator[indexer_pb2.FindMatchesQueries], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[indexer_pb2.FindMatchesAnswers]:
        async for message in request_iterator:
            self.message_sizes.append(len(message.queries))
            if self.behaviour == "silent":
                continue
            if self.behaviour == "hold":
                await self.release.wait()
            answers = []
            for query in message.queries:
                answer = indexer_pb2.FindMatchesAnswer(query_id=query.query_id)
                if self.behaviour == "refuse":
                    answer.refused = "query longer than 1 blocks"
                else:
                    blocks = len(query.request.sequence_hashes)
                    answer.response.workers.add(worker_id=1, matched_blocks=blocks, total_blocks=100)
                answers.append(answer)
            yield indexer_pb2.FindMatchesAnswers(answers=answers)


class Replicas:
    """What the client reads of discovery: the replicas' records, in a fixed order."""

    def __init__(self, servers: list[GrpcService]) -> None:
        self.records = [
            InstanceRecord(component="indexer", instance_id=i + 1, address=f"127.0.0.1:{s.port}")
            for i, s in enumerate(servers)
        ]

    def instances(self) -> list[InstanceRecord]:
        return list(self.records)


class InOrder(random.Random):
    """Asks the replicas in the order discovery lists them, so a test decides who is asked first."""

    def shuffle(self, x: list) -> None:  # type: ignore[override]
        return None


async def serve(servicer: ScriptedIndexer) -> GrpcService:
    return await start_grpc_server(
        lambda server: indexer_pb2_grpc.add_IndexerServicer_to_server(servicer, server), ["kvmesh.v1.Indexer"]
    )


async def test_concurrent_queries_share_messages_and_each_gets_its_own_answer():
    indexer = ScriptedIndexer("answer")
    server = await serve(indexer)
    client = IndexerClient(Replicas([server]), ChannelPool(), 5.0, random.Random(0))  # type: ignore[arg-type]
    try:
        views = await asyncio.gather(*(client.find_matches(list(range(n))) for n in range(1, 21)))
        assert [view.matched[(1, 0)] for view in views] == list(range(1, 21))
        assert sum(indexer.message_sizes) == 20 and max(indexer.message_sizes) > 1
        assert len(indexer.message_sizes) < 20
    finally:
        await client.close()
        await server.stop(0)


async def test_a_silent_or_refusing_replica_is_passed_over_for_the_next():
    silent, refusing, answering = ScriptedIndexer("silent"), ScriptedIndexer("refuse"), ScriptedIndexer("answer")
    servers = [await serve(i) for i in (silent, refusing, answering)]
    client = IndexerClient(Replicas(servers), ChannelPool(), 0.3, InOrder())  # type: ignore[arg-type]
    try:
        for blocks in (3, 5):
            view = await client.find_matches(list(range(blocks)))
            assert view.matched == {(1, 0): blocks}
        assert silent.message_sizes and refusing.message_sizes  # both were asked first, each time
    finally:
        await client.close()
        for server in servers:
            await server.stop(0)


async def test_queries_in_flight_on_a_replica_that_dies_go_to_the_next():
    dying, answering = ScriptedIndexer("hold"), ScriptedIndexer("answer")
    servers = [await serve(dying), await serve(answering)]
    # a deadline far past the test's own: only noticing the broken stream can answer in time
    client = IndexerClient(Replicas(servers), ChannelPool(), 600.0, InOrder())  # type: ignore[arg-type]
    try:
        queries = [asyncio.create_task(client.find_matches(list(range(n)))) for n in (2, 4)]
        await wait_until_async(lambda: sum(dying.message_sizes) == 2, what="both queries at the first replica")
        await servers[0].stop(0)
        views = await asyncio.wait_for(asyncio.gather(*queries), timeout=30)
        assert [view.matched for view in views] == [{(1, 0): 2}, {(1, 0): 4}]
        # the dead replica is asked again, fails at once, and the next one answers
        view = await asyncio.wait_for(client.find_matches([1, 2, 3]), timeout=30)
        assert view.matched == {(1, 0): 3}
    finally:
        await client.close()
        await servers[1].stop(0)


async def test_queries_given_up_on_a_silent_replica_are_not_kept():
    silent = ScriptedIndexer("silent")
    server = await serve(silent)
    client = IndexerClient(Replicas([server]), ChannelPool(), 0.05, InOrder())  # type: ignore[arg-type]
    try:
        for _ in range(5):
            assert (await client.find_matches([1, 2])).matched == {}  # routing goes on load alone
        streams = list(client._streams._streams.values())
        assert len(streams) == 1 and not streams[0]._waiting
    finally:
        await client.close()
        await server.stop(0)
