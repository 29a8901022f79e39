"""Worker events → JetStream → indexer, against a real NATS server."""

from __future__ import annotations

import asyncio
import os
import signal

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig

from kvmesh.common.core.prefix_index import PrefixIndex
from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.runtime.kv_event_stream import ensure_kv_events_stream
from kvmesh.common.runtime.nats_server import EmbeddedNatsServer
from kvmesh.common.wire import names
from kvmesh.common.wire.kv_events import BlocksStored, KvEvent, KvEventBatch, StoredBlock, decode_batch, encode_batch
from kvmesh.indexer import consumer as consumer_module
from kvmesh.indexer.consumer import EventStreamConsumer
from kvmesh.worker.engines.mock.mock_engine import EngineConfig, EngineRequestSpec, MockEngine
from kvmesh.worker.event_publisher import KvEventPublisher
from tests.support import wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "itest"


def run_requests(engine: MockEngine, publisher: KvEventPublisher, prompts: list[list[int]]) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequestSpec(f"r{i}-{len(prompt)}-{prompt[0]}", prompt, max_tokens=3))
        while engine.has_work():
            engine.step()
            publisher.enqueue(engine.drain_events())


def workload(seed: int, count: int) -> list[list[int]]:
    shared = [seed * 7 + t for t in range(48)]
    return [shared + [seed * 1000 + i * 10 + t for t in range(20 + i % 30)] for i in range(count)]


async def test_events_flow_from_worker_to_indexer(nc: NatsClient):
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    engines = {wid: MockEngine(EngineConfig(num_blocks=40, block_size=16)) for wid in (101, 202)}
    publishers = {wid: KvEventPublisher(js, NAMESPACE, wid) for wid in engines}
    for p in publishers.values():
        await p.start()
    index = PrefixIndex()
    consumer = EventStreamConsumer(nc, NAMESPACE, "a", index)
    await consumer.start()
    try:
        for wid, engine in engines.items():
            run_requests(engine, publishers[wid], workload(wid, 30))  # small cache: evictions happen
        for p in publishers.values():
            await p.flush()

        def converged() -> bool:
            return all(index.worker_blocks((w, 0)) == e.blocks.cached_hashes() for w, e in engines.items())

        await wait_until_async(converged, timeout=15, what="index == workers' caches")
        assert all(e.blocks.num_cached > 0 for e in engines.values())
        assert index.stats.gaps == 0 and index.stats.unknown_parent == 0
        # the shared prefix of worker 101's prompts is found by an overlap query
        overlaps = index.find_matches(_local(workload(101, 1)[0]))
        assert overlaps[(101, 0)] >= 3 and (202, 0) not in overlaps
    finally:
        await consumer.stop()
        for p in publishers.values():
            await p.stop()


def _local(tokens: list[int]) -> list[int]:
    from kvmesh.common.wire.hashing import local_block_hashes

    return local_block_hashes(tokens, 16)


async def test_a_retried_publish_is_stored_once(nc: NatsClient):
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    batch = KvEventBatch(7, 0, 0.0, (KvEvent(0, BlocksStored(None, (StoredBlock(1, 1, 16),))),))
    headers = {"Nats-Msg-Id": names.kv_event_msg_id(7, 0, 0)}
    subject = names.kv_events_subject(NAMESPACE, 7)
    first = await js.publish(subject, encode_batch(batch), headers=headers)
    second = await js.publish(subject, encode_batch(batch), headers=headers)
    assert second.duplicate and not first.duplicate
    info = await js.stream_info(names.KV_EVENTS_STREAM)
    assert info.state.messages == 1


async def test_a_restarted_indexer_resumes_from_its_durable_consumer(nc: NatsClient):
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    engine = MockEngine(EngineConfig(num_blocks=64, block_size=16))
    publisher = KvEventPublisher(js, NAMESPACE, 55)
    await publisher.start()
    first_index = PrefixIndex()
    first = EventStreamConsumer(nc, NAMESPACE, "r1", first_index)
    await first.start()
    run_requests(engine, publisher, workload(1, 20))
    await publisher.flush()
    stream_last = (await js.stream_info(names.KV_EVENTS_STREAM)).state.last_seq
    await wait_until_async(lambda: first.applied_sequence == stream_last, what="first replica caught up")

    async def acked() -> bool:
        info = await js.consumer_info(names.KV_EVENTS_STREAM, first.durable)
        return info.ack_floor.stream_seq == stream_last

    await wait_until_async(acked, what="acks reach the server")
    created = (await js.consumer_info(names.KV_EVENTS_STREAM, first.durable)).created
    await first.stop()  # the replica goes away mid-stream; the workers keep going

    run_requests(engine, publisher, workload(2, 20))
    await publisher.flush()
    new_last = (await js.stream_info(names.KV_EVENTS_STREAM)).state.last_seq
    assert new_last > stream_last

    restarted_index = PrefixIndex()  # a new process: empty memory, same replica id
    restarted = EventStreamConsumer(nc, NAMESPACE, "r1", restarted_index)
    await restarted.start()
    try:
        await wait_until_async(
            lambda: restarted_index.worker_blocks((55, 0)) == engine.blocks.cached_hashes(),
            what="restarted replica converges",
        )
        info = await js.consumer_info(names.KV_EVENTS_STREAM, restarted.durable)
        assert info.created == created  # the same durable consumer, not a new one
        await wait_until_async(lambda: restarted.applied_sequence == new_last, what="all applied")
        # each message applied exactly once: no duplicate event was even offered to the index
        assert restarted_index.stats.duplicates_skipped == 0
    finally:
        await restarted.stop()
        await publisher.stop()


async def test_reset_states_starts_a_replica_clean(nc: NatsClient):
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    index = PrefixIndex()
    consumer = EventStreamConsumer(nc, NAMESPACE, "reset", index)
    await consumer.start()
    await consumer.stop()
    created = (await js.consumer_info(names.KV_EVENTS_STREAM, consumer.durable)).created
    again = EventStreamConsumer(nc, NAMESPACE, "reset", PrefixIndex())
    await again.start(reset=True)
    try:
        assert (await js.consumer_info(names.KV_EVENTS_STREAM, again.durable)).created != created
    finally:
        await again.stop()


@pytest.mark.parametrize(("flush_s", "messages"), [(0.0, 3), (0.5, 1)])
async def test_events_queued_within_the_flush_window_share_one_message(nc: NatsClient, flush_s: float, messages: int):
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    worker_id = 40 + messages
    publisher = KvEventPublisher(js, NAMESPACE, worker_id, flush_interval_s=flush_s)
    await publisher.start()
    try:
        for step in range(3):  # three engine steps, 20 ms apart (the publisher runs in between)
            publisher.enqueue([BlocksStored(None, (StoredBlock(step, step, 16),))])
            if flush_s:
                await asyncio.sleep(0.02)  # time passing between steps, well inside the window
            else:
                await publisher.flush()  # without a window each step's events are published alone
        await publisher.flush()
    finally:
        await publisher.stop()
    subject = names.kv_events_subject(NAMESPACE, worker_id)
    subscription = await js.subscribe(subject, ordered_consumer=True)
    batches = []
    while sum(len(b.events) for b in batches) < 3:
        batches.append(decode_batch((await subscription.next_msg(timeout=5)).data))
    await subscription.unsubscribe()
    assert len(batches) == messages
    assert [e.event_id for b in batches for e in b.events] == [0, 1, 2]


async def test_one_ack_covers_the_messages_applied_before_it(nc: NatsClient):
    """AckPolicy.ALL: the replica acknowledges the last message it applied, not every message."""
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    acks: list[bytes] = []
    watcher = await nc.subscribe(
        f"$JS.ACK.{names.KV_EVENTS_STREAM}.{names.indexer_durable_name(NAMESPACE, 'batched')}.>"
    )
    watcher_task = asyncio.create_task(_collect(watcher, acks))
    publisher = KvEventPublisher(js, NAMESPACE, 77)
    await publisher.start()
    engine = MockEngine(EngineConfig(num_blocks=256, block_size=16))
    for prompt in workload(7, 40):  # a stream message (or more) per request
        run_requests(engine, publisher, [prompt])
        await publisher.flush()
    stream_last = (await js.stream_info(names.KV_EVENTS_STREAM)).state.last_seq
    consumer = EventStreamConsumer(nc, NAMESPACE, "batched", PrefixIndex())
    await consumer.start()  # the whole backlog is waiting: delivered at once
    try:
        assert (await js.consumer_info(names.KV_EVENTS_STREAM, consumer.durable)).config.ack_policy == "all"

        async def acked() -> bool:
            return (
                await js.consumer_info(names.KV_EVENTS_STREAM, consumer.durable)
            ).ack_floor.stream_seq == stream_last

        await wait_until_async(acked, what="the ack floor reaches the stream's end")
        assert consumer.applied_sequence == stream_last >= 40
        assert 0 < len(acks) <= stream_last // 4, f"{len(acks)} acks for {stream_last} messages"
    finally:
        await consumer.stop()
        await publisher.stop()
        watcher_task.cancel()
        await watcher.unsubscribe()


async def test_a_durable_that_acked_each_message_is_remade_to_ack_all_without_losing_events(nc: NatsClient):
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    durable = names.indexer_durable_name(NAMESPACE, "old")
    engine = MockEngine(EngineConfig(num_blocks=64, block_size=16))
    publisher = KvEventPublisher(js, NAMESPACE, 66)
    await publisher.start()
    run_requests(engine, publisher, workload(3, 10))
    await publisher.flush()
    # what an earlier version made: explicit acks, and its first messages acknowledged
    await js.add_consumer(
        names.KV_EVENTS_STREAM,
        ConsumerConfig(
            durable_name=durable, ack_policy=AckPolicy.EXPLICIT, filter_subject=names.kv_events_wildcard(NAMESPACE)
        ),
    )
    old = await js.pull_subscribe_bind(durable, stream=names.KV_EVENTS_STREAM)
    for msg in await old.fetch(3, timeout=5):
        await msg.ack_sync()
    await old.unsubscribe()
    run_requests(engine, publisher, workload(4, 10))
    await publisher.flush()
    index = PrefixIndex()
    consumer = EventStreamConsumer(nc, NAMESPACE, "old", index)
    await consumer.start()
    try:
        assert (await js.consumer_info(names.KV_EVENTS_STREAM, durable)).config.ack_policy == "all"
        await wait_until_async(
            lambda: index.worker_blocks((66, 0)) == engine.blocks.cached_hashes(), what="the index converges"
        )
        assert index.stats.gaps == 0 and index.stats.duplicates_skipped == 0
    finally:
        await consumer.stop()
        await publisher.stop()


async def _collect(subscription, into: list[bytes]) -> None:
    async for msg in subscription.messages:
        into.append(msg.data)


async def test_a_replica_killed_before_its_acks_left_restarts_without_a_gap(nc: NatsClient, monkeypatch):
    """Messages delivered to a replica that died before acknowledging them come back only after the
    durable's ack wait (30 s); the restarted replica replays them itself, up to what was delivered,
    instead of applying the newer ones first and then skipping those as already applied."""

    # the first replica dies before any of its acks leave: none is due before the kill
    monkeypatch.setattr(consumer_module, "ACK_WINDOW_S", 3600.0)
    monkeypatch.setattr(consumer_module, "ACK_EVERY", 1 << 30)
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    engine = MockEngine(EngineConfig(num_blocks=64, block_size=16))
    publisher = KvEventPublisher(js, NAMESPACE, 44)
    await publisher.start()
    first = EventStreamConsumer(nc, NAMESPACE, "killed", PrefixIndex())
    await first.start()
    for prompt in workload(5, 12):
        run_requests(engine, publisher, [prompt])
        await publisher.flush()
    stream_last = (await js.stream_info(names.KV_EVENTS_STREAM)).state.last_seq
    await wait_until_async(lambda: first.applied_sequence == stream_last, what="first replica caught up")
    # a kill -9: whatever was applied but not yet acknowledged is never acknowledged
    await cancel_and_wait(first._acker)
    await first._pull.stop()
    info = await js.consumer_info(names.KV_EVENTS_STREAM, first.durable)
    assert info.delivered.stream_seq == stream_last and info.ack_floor.stream_seq < stream_last

    for prompt in workload(6, 12):
        run_requests(engine, publisher, [prompt])
        await publisher.flush()
    index = PrefixIndex()
    restarted = EventStreamConsumer(nc, NAMESPACE, "killed", index)
    await restarted.start()
    try:
        await wait_until_async(
            lambda: index.worker_blocks((44, 0)) == engine.blocks.cached_hashes(),
            timeout=10,
            what="the restarted replica converges well before the ack wait",
        )
        assert index.stats.gaps == 0
    finally:
        await restarted.stop()
        await publisher.stop()


async def test_deliveries_that_never_reached_the_replica_are_read_from_the_stream(nc: NatsClient):
    """The durable delivered a message to a pull request the replica never saw (as when a partition
    deposes the consumer's leader with a request in flight). Acknowledging the next message would
    acknowledge it too (AckPolicy.ALL) and no redelivery would come: the replica notices the jump
    in the durable's delivery count and reads it from the stream."""
    namespace = "lostdeliveries"
    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    durable = names.indexer_durable_name(namespace, "lost")
    config = ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.ALL,
        filter_subject=names.kv_events_wildcard(namespace),
        max_ack_pending=-1,
        ack_wait=30,
    )
    await js.add_consumer(names.KV_EVENTS_STREAM, config)
    # the lost pull request: first in line for the durable's next message, then gone
    lost: list[int] = []

    async def take(msg) -> None:
        if msg.headers is None or "Status" not in msg.headers:
            lost.append(msg.metadata.sequence.stream)

    lost_sub = await nc.subscribe(nc.new_inbox(), cb=take)
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{names.KV_EVENTS_STREAM}.{durable}"
    await nc.publish(next_subject, b'{"batch": 1, "expires": 20000000000}', reply=lost_sub.subject)
    await nc.flush()
    index = PrefixIndex()
    consumer = EventStreamConsumer(nc, namespace, "lost", index)
    await consumer.start()
    try:

        async def publish(worker: int, *blocks: int) -> None:
            events = tuple(KvEvent(i, BlocksStored(None, (StoredBlock(b, b, 16),))) for i, b in enumerate(blocks))
            subject = names.kv_events_subject(namespace, worker)
            await js.publish(subject, encode_batch(KvEventBatch(worker, 0, 0.0, events)))

        await publish(2, 20, 21)  # worker 2's last events: nothing after them would reveal a gap
        await wait_until_async(lambda: len(lost) == 1, what="the lost request took worker 2's message")
        await publish(1, 10)
        await wait_until_async(
            lambda: index.worker_blocks((2, 0)) == {20, 21} and index.worker_blocks((1, 0)) == {10},
            timeout=10,
            what="the replica holds worker 2's blocks too",
        )
        assert consumer.missed_deliveries == 1 and index.stats.gaps == 0
    finally:
        await consumer.stop()
        await lost_sub.unsubscribe()


async def test_missed_messages_the_stream_does_not_answer_for_at_once_are_read_when_it_does():
    """A replay that asks a stream too early (its server not answering, as a leader right after a
    partition heals) asks again, and does not take the silence for messages purged: acknowledging
    past them would lose them for good."""
    server = await EmbeddedNatsServer().start()
    client = await nats.connect(server.url)
    namespace = "silentstream"
    index = PrefixIndex()
    consumer = EventStreamConsumer(client, namespace, "patient", index)
    try:
        js = client.jetstream()
        await ensure_kv_events_stream(js)
        for worker in (1, 2, 3):
            event = KvEvent(0, BlocksStored(None, (StoredBlock(worker * 10, worker * 10, 16),)))
            await js.publish(
                names.kv_events_subject(namespace, worker), encode_batch(KvEventBatch(worker, 0, 0.0, (event,)))
            )
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            replay = asyncio.create_task(consumer._replay(3))
            await wait_until_async(lambda: consumer.replay_retries >= 1, timeout=30, what="a read asked again")
        finally:
            os.kill(server.pid, signal.SIGCONT)
        await asyncio.wait_for(replay, timeout=60)
        assert consumer.applied_sequence == 3
        assert [index.worker_blocks((w, 0)) for w in (1, 2, 3)] == [{10}, {20}, {30}]
    finally:
        await client.close()
        server.stop()
