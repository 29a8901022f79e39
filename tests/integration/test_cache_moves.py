"""Cached blocks moved between live mock workers over real NATS, gRPC and the KV transfer: a worker
stopped with --shrink-handoff-blocks hands its hot blocks on, so a session's next turn finds its
prefix cached on a survivor (and is faster than without the move); a worker started with
--join-warmup-blocks imports the busiest workers' hot blocks before it registers; a request whose
prefix's holder is saturated is sent elsewhere with that prefix pulled (by default, where it names
its session; not with --kv-pull-ratio 0); a pull from a holder that does not answer gives up at its
bound, and an engine that cannot take blocks serves the request without pulling."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import grpc
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import common_pb2, indexer_pb2, indexer_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.common.rpc.grpc_server import start_grpc_server
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.ports import pid_listening_on
from kvmesh.common.wire import disagg
from kvmesh.common.wire.hashing import local_block_hashes, sequence_hashes
from kvmesh.worker.cache_moves import PULL_BOUND_S
from tests.integration.test_stream_sessions import one_worker
from tests.support import metric_samples, router_generate, service_process, wait_until_async, worker_mesh

pytestmark = pytest.mark.integration
NAMESPACE = "moves"
BLOCK = 16
TURN_1 = list(range(5000, 5000 + BLOCK * 120 + 3))  # 120 full blocks
TURN_2 = [*TURN_1, *range(9000, 9000 + BLOCK * 4)]  # the session's next turn: the same history and more
# slow enough that recomputing 120 blocks shows in the time to first token (about 60 ms, well above
# a loaded machine's jitter), fast enough for a test
FLAGS = ("--speedup-ratio", "0.5", "--lease-ttl", "30", "--drain-timeout-secs", "2")


@contextlib.asynccontextmanager
async def mesh(
    nc: NatsClient,
    nats_url: str,
    *worker_flags: str,
    workers: int = 2,
    namespace: str = NAMESPACE,
    router_flags: tuple[str, ...] = (),
):
    """Yields (router address, indexer address, worker processes, the workers' watcher)."""
    async with worker_mesh(nc, nats_url, namespace, (*FLAGS, *worker_flags), workers, router_flags) as up:
        yield up.router, up.indexer, up.processes, up.workers


async def matched_blocks(indexer: str, prompt: list[int]) -> dict[int, int]:
    request = indexer_pb2.FindMatchesRequest(sequence_hashes=sequence_hashes(local_block_hashes(prompt, BLOCK)))
    async with grpc.aio.insecure_channel(indexer) as channel:
        response = await indexer_pb2_grpc.IndexerStub(channel).FindMatches(request)
    return {w.worker_id: w.matched_blocks for w in response.workers if w.matched_blocks}


async def cached_on(address: str) -> set[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        dump = await worker_pb2_grpc.WorkerStub(channel).DumpKvState(worker_pb2.DumpKvStateRequest(), timeout=5)
    return {b.sequence_hash for b in dump.blocks}


async def timed_turn(router: str, request_id: str, prompt: list[int], session: str = "") -> tuple[float, int, int]:
    """(time to first token in ms, prompt tokens found cached, the worker that served it)."""
    started = time.perf_counter()
    first: list[float] = []
    outputs = await router_generate(
        router,
        request_id,
        prompt,
        2,
        on_output=lambda _: first.append(time.perf_counter()) if not first else None,
        session=session,
    )
    return (first[0] - started) * 1000, outputs[-1].usage.cached_prompt_tokens, outputs[-1].worker_id


async def stop_the_holder(processes, workers: DiscoveryWatcher, worker_id: int) -> None:
    record = workers.get(worker_id)
    assert record is not None
    port = int(record.address.rsplit(":", 1)[1])
    victim = next(p for p in processes if pid_listening_on(port) == p.pid)
    victim.send_signal(signal.SIGTERM)
    await wait_until_async(lambda: _exited(victim), timeout=30, what="the holder stopped")


async def _exited(process) -> bool:
    return process.poll() is not None


async def next_turn_after_a_shrink(nc: NatsClient, nats_url: str, *flags: str) -> tuple[float, int, int]:
    """A session's first turn, its worker stopped, then its next turn: (TTFT ms, cached tokens, the
    survivor's blocks of the first turn the indexer reported before the next turn)."""
    namespace = "moves-handed-on" if flags else "moves-cold"
    async with mesh(nc, nats_url, *flags, namespace=namespace) as (router, indexer, processes, workers):
        _, _, holder = await timed_turn(router, "turn-1", TURN_1)
        await stop_the_holder(processes, workers, holder)
        (survivor,) = [r.instance_id for r in workers.instances() if r.instance_id != holder]
        if flags:
            await wait_until_async(
                lambda: _at_least(matched_blocks(indexer, TURN_1), survivor, 120),
                timeout=20,
                what="moved blocks indexed",
            )
        held = (await matched_blocks(indexer, TURN_1)).get(survivor, 0)
        ttft, cached, served_by = await timed_turn(router, "turn-2", TURN_2)
        assert served_by == survivor
        return ttft, cached, held


async def _at_least(pending, worker: int, blocks: int) -> bool:
    return (await pending).get(worker, 0) >= blocks


async def test_a_stopped_worker_hands_its_cache_on_and_the_next_turn_finds_it(nats_url: str, nc: NatsClient):
    ttft_moved, cached_moved, held_moved = await next_turn_after_a_shrink(
        nc, nats_url, "--shrink-handoff-blocks", "4096"
    )
    ttft_cold, cached_cold, held_cold = await next_turn_after_a_shrink(nc, nats_url)
    # the survivor holds the whole first turn, indexed through its own KV events, and serves it
    assert held_moved == 120 and cached_moved == 120 * BLOCK
    assert held_cold == 0 and cached_cold == 0
    # recomputing 120 blocks is what the move saves: the next turn's first token comes sooner
    assert ttft_moved < ttft_cold, (ttft_moved, ttft_cold)


async def test_a_joining_worker_imports_the_hot_blocks_before_it_registers(nats_url: str, nc: NatsClient):
    async with mesh(nc, nats_url, workers=1) as (router, _indexer, processes, workers):
        _, _, holder = await timed_turn(router, "hot", TURN_1)
        hot = sequence_hashes(local_block_hashes(TURN_1, BLOCK))[:120]
        joiner = service_process("worker", nats_url, NAMESPACE, *FLAGS, "--join-warmup-blocks", "4096")
        processes.append(joiner)
        await wait_until_async(lambda: _count(workers, 2), timeout=30, what="the joiner registered")
        (record,) = [r for r in workers.instances() if r.instance_id != holder]
        # registered only once warm: every block of the hot prompt is already in its cache
        assert set(hot) <= await cached_on(record.address)
        outputs = await router_generate(router, "on-joiner", TURN_2, 2, record.instance_id)
        assert outputs[-1].usage.cached_prompt_tokens == 120 * BLOCK
        # each worker's metrics say what it gave and took
        assert move_counters(record) == {"offered": 0, "taken": 120}
        assert move_counters(workers.get(holder)) == {"offered": 120, "taken": 0}


async def test_an_offer_that_names_no_room_is_refused_and_changes_nothing(nats_url: str, nc: NatsClient):
    async with mesh(nc, nats_url, workers=1) as (router, _indexer, _processes, workers):
        await router_generate(router, "warm", TURN_1, 2)
        (record,) = workers.instances()
        before = await cached_on(record.address)
        bad = worker_pb2.BlockOffer(worker_id=1, blocks=[worker_pb2.OfferedBlock(sequence_hash=1, tokens_hash=1)])
        async with grpc.aio.insecure_channel(record.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await worker_pb2_grpc.WorkerStub(channel).TakeBlocks(bad, timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "host, port and room" in (refused.value.details() or "")
        assert await cached_on(record.address) == before


def move_counters(record) -> dict[str, float]:
    samples = metric_samples(record.extra["metrics"], "kvmesh_worker_cache_move_blocks_total")
    return {labels["direction"]: value for labels, value in samples}


async def _count(workers: DiscoveryWatcher, count: int) -> bool:
    return len(workers.instances()) == count


async def next_turn_beside_a_busy_holder(
    nc: NatsClient, nats_url: str, namespace: str, *router_flags: str, session: str = "s1"
):
    """A session's first turn, then its holder kept busy with long prompts named for it, then the
    session's next turn routed freely, both turns naming ``session`` (empty: anonymous): (the holder,
    the other worker, the next turn's worker, its cached prompt tokens, each worker's move counters,
    the holder's offer of the next turn's prompt)."""
    async with mesh(nc, nats_url, namespace=namespace, router_flags=router_flags) as (router, indexer, _, workers):
        _, _, holder = await timed_turn(router, "turn-1", TURN_1, session)
        (other,) = [r.instance_id for r in workers.instances() if r.instance_id != holder]
        await wait_until_async(
            lambda: _at_least(matched_blocks(indexer, TURN_1), holder, 120), timeout=20, what="turn 1 indexed"
        )
        # prefills the router knows to be queued there: the holder's cost is far past the other's
        busy = [
            asyncio.create_task(
                router_generate(router, f"busy-{i}", list(range(20_000 * (i + 1), 20_000 * (i + 1) + 4000)), 2, holder)
            )
            for i in range(4)
        ]
        record = workers.get(holder)
        await wait_until_async(lambda: _in_flight_at_least(record.address, 4), timeout=20, what="the holder busy")
        _, cached, served_by = await timed_turn(router, "turn-2", TURN_2, session)
        await asyncio.gather(*busy)
        counters = {w: move_counters(workers.get(w)) for w in (holder, other)}
        hashes = sequence_hashes(local_block_hashes(TURN_2, BLOCK))
        async with grpc.aio.insecure_channel(record.address) as channel:
            offer = await worker_pb2_grpc.WorkerStub(channel).OfferBlocks(
                worker_pb2.OfferBlocksRequest(sequence_hashes=hashes), timeout=5
            )
        return holder, other, served_by, cached, counters, offer


async def _in_flight_at_least(address: str, count: int) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        status = await worker_pb2_grpc.WorkerStub(channel).GetStatus(worker_pb2.WorkerStatusRequest(), timeout=5)
    return status.running_requests + status.waiting_requests >= count


async def test_a_busy_holder_s_prefix_is_pulled_by_the_worker_that_serves_the_turn(nats_url: str, nc: NatsClient):
    # the router's default --kv-pull-ratio, for a turn that names its session (decision 71)
    holder, other, served_by, cached, counters, offer = await next_turn_beside_a_busy_holder(nc, nats_url, "pull")
    # the turn went to the idle worker, which pulled the 120 blocks and computed only the rest
    assert served_by == other
    assert cached == 120 * BLOCK
    assert counters[other]["taken"] == 120 and counters[holder]["offered"] == 120
    # a holder offers a prompt's blocks up to the first it does not hold: the turn's new 4 are elsewhere
    assert [b.sequence_hash for b in offer.blocks] == sequence_hashes(local_block_hashes(TURN_2, BLOCK))[:120]
    assert offer.room


@pytest.mark.parametrize(
    ("namespace", "flags", "session"),
    [("pull-off", ("--kv-pull-ratio", "0"), "s1"), ("pull-anonymous", (), "")],
    ids=["pulls off", "anonymous turns"],
)
async def test_the_turn_is_not_pulled_without_pulls_or_without_a_session(
    nats_url: str, nc: NatsClient, namespace: str, flags: tuple[str, ...], session: str
):
    holder, other, served_by, cached, counters, _ = await next_turn_beside_a_busy_holder(
        nc, nats_url, namespace, *flags, session=session
    )
    assert counters[other].get("taken", 0) == 0
    # piled onto the holder, or recomputed on the other worker
    assert (served_by, cached) in {(holder, 120 * BLOCK), (other, 0)}


class SilentHolder(worker_pb2_grpc.WorkerServicer):
    """A holder asked for an offer that never answers (a worker stalled, or its host unreachable
    mid-call); it records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[worker_pb2.OfferBlocksRequest] = []
        self._never = asyncio.Event()

    async def OfferBlocks(self, request: worker_pb2.OfferBlocksRequest, context) -> worker_pb2.BlockOffer:
        self.asked.append(request)
        await self._never.wait()  # cancelled when the caller gives up or the server stops
        return worker_pb2.BlockOffer()


@contextlib.asynccontextmanager
async def silent_holder():
    """Yields (the holder, its address)."""
    holder = SilentHolder()
    server = await start_grpc_server(
        lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(holder, s), ["kvmesh.v1.Worker"]
    )
    try:
        yield holder, f"127.0.0.1:{server.port}"
    finally:
        await server.stop()


async def served_with_a_pull(address: str, holder_address: str, dp_rank: int | None = None) -> tuple[int, int]:
    """Generate TURN_1 on the worker at ``address``, told to pull its prefix from ``holder_address``
    first; (output tokens, cached prompt tokens). Its deadline is well inside the KV transfer's
    timeout (30 s by default), so only the pull's own bound lets it finish."""
    hashes = sequence_hashes(local_block_hashes(TURN_1, BLOCK))
    pull = disagg.PrefixPull(7, holder_address, hashes)
    request = common_pb2.PreprocessedRequest(
        request_id="pulled", token_ids=TURN_1, disaggregated_params=disagg.encode(pull)
    )
    request.stop.max_tokens = 3
    request.stop.ignore_eos = True
    if dp_rank is not None:
        request.routing.dp_rank = dp_rank
    tokens, cached = 0, 0
    async with grpc.aio.insecure_channel(address) as channel:
        async for output in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=PULL_BOUND_S + 10):
            tokens += len(output.token_ids)
            cached = max(cached, output.usage.cached_prompt_tokens)
    return tokens, cached


async def test_a_pull_the_holder_never_answers_gives_up_at_its_bound(nats_url: str, nc: NatsClient):
    async with silent_holder() as (holder, holder_address), one_worker(nc, nats_url, *FLAGS) as (address, _):
        # the request waits for the pull at most PULL_BOUND_S, then computes its whole prompt
        assert await served_with_a_pull(address, holder_address) == (3, 0)
        assert len(holder.asked) == 1
        assert list(holder.asked[0].sequence_hashes) == sequence_hashes(local_block_hashes(TURN_1, BLOCK))


async def test_an_engine_that_cannot_take_blocks_serves_a_pull_order_without_pulling(nats_url: str, nc: NatsClient):
    # the moves serve rank 0's engine: a request for rank 1 is served there as if no pull were named
    flags = (*FLAGS, "--data-parallel-size", "2")
    async with silent_holder() as (holder, holder_address), one_worker(nc, nats_url, *flags) as (address, _):
        assert await served_with_a_pull(address, holder_address, dp_rank=1) == (3, 0)
        assert not holder.asked
