"""Worker events → JetStream → indexer, against a real NATS server."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common import names
from kvmesh.common.kv_events import BlocksStored, KvEvent, KvEventBatch, StoredBlock, decode_batch, encode_batch
from kvmesh.common.prefix_index import PrefixIndex
from kvmesh.common.streams import ensure_kv_events_stream
from kvmesh.indexer.consumer import EventStreamConsumer
from kvmesh.worker.event_publisher import KvEventPublisher
from kvmesh.worker.mock_engine import EngineConfig, EngineRequestSpec, MockEngine
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
    from kvmesh.common.hashing import local_block_hashes

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
