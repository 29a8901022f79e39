"""Standing pull requests on a durable consumer, against a real NATS server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from kvmesh.indexer.standing_pull import StandingPull
from tests.support import wait_until_async

pytestmark = pytest.mark.integration


@pytest.fixture
async def stream(nc: NatsClient) -> AsyncIterator[str]:
    name = f"SP{uuid.uuid4().hex[:8]}"
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=name, subjects=[f"{name}.>"]))
    try:
        yield name
    finally:
        await js.delete_stream(name)


async def add_durable(nc: NatsClient, stream: str, durable: str) -> None:
    config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, max_ack_pending=-1)
    await nc.jetstream().add_consumer(stream, config)


class Received:
    """The handler under test: records each message's stream sequence and acks it."""

    def __init__(self) -> None:
        self.sequences: list[int] = []

    async def __call__(self, msg: Msg) -> None:
        self.sequences.append(msg.metadata.sequence.stream)
        await msg.ack()


async def test_messages_arrive_in_order_acked_with_a_pull_request_per_half_batch(nc: NatsClient, stream: str):
    await add_durable(nc, stream, "d")
    received = Received()
    pull = StandingPull(nc, stream, "d", received, batch=16)
    await pull.start()
    try:
        js = nc.jetstream()
        for i in range(100):
            await js.publish(f"{stream}.e", str(i).encode())
        await wait_until_async(lambda: len(received.sequences) == 100, timeout=10, what="100 messages")
        assert received.sequences == list(range(1, 101))
        # topped up when half of the 16 asked for had come: about one request per 8 messages, where
        # a fetch per delivery would have sent two per message
        assert pull.requests_sent <= 100 // 8 + 2

        # an ack is a publish without a reply: the server may apply the last ones a moment later
        async def all_acked() -> bool:
            return (await js.consumer_info(stream, "d")).ack_floor.stream_seq == 100

        await wait_until_async(all_acked, timeout=10, what="the ack floor at the 100th message")
    finally:
        await pull.stop()


async def test_an_expired_request_is_replaced_and_later_messages_still_arrive(nc: NatsClient, stream: str):
    await add_durable(nc, stream, "d")
    received = Received()
    pull = StandingPull(nc, stream, "d", received, batch=4, expires_s=0.6, heartbeat_s=0.2, check_s=30)
    await pull.start()
    try:
        await wait_until_async(lambda: pull.requests_sent >= 3, timeout=5, what="expired requests replaced")
        await nc.jetstream().publish(f"{stream}.e", b"late")
        await wait_until_async(lambda: received.sequences == [1], timeout=5, what="the message after the expiries")
    finally:
        await pull.stop()


async def test_a_request_the_server_never_answers_is_replaced(nc: NatsClient, stream: str):
    # The durable does not exist yet when the first request goes out: only "no responders" comes
    # back, and after it silence, as after a restart that forgot the request. Two heartbeats of
    # silence renew it.
    received = Received()
    pull = StandingPull(nc, stream, "late", received, batch=4, expires_s=2.0, heartbeat_s=0.2, check_s=0.1)
    await pull.start()
    try:
        await add_durable(nc, stream, "late")
        await nc.jetstream().publish(f"{stream}.e", b"first")
        await wait_until_async(lambda: received.sequences == [1], timeout=5, what="the message once renewed")
        assert pull.requests_sent >= 2
    finally:
        await pull.stop()


async def test_heartbeats_for_a_lost_request_do_not_hide_waiting_messages(nc: NatsClient, stream: str):
    # As after a partition: the consumer leader that held the request was deposed and still sends
    # idle heartbeats for it, while the new leader holds messages and no request. Here the request
    # goes out before the durable exists (lost: the server answers "no responders", after which the
    # pull counts it as standing again, as it would a request it never heard of again), and
    # heartbeats are published onto the pull's inbox.
    received = Received()
    pull = StandingPull(nc, stream, "deposed", received, batch=4, expires_s=2.0, heartbeat_s=0.2, check_s=0.05)
    await pull.start()
    await wait_until_async(lambda: pull._pending == 0, timeout=5, what="the lost request's no-responders answer")
    pull._pending = 4  # what the pull believes after a request the server lost without a word
    beating = True

    async def heartbeats() -> None:
        while beating:
            await nc.publish(pull._inbox, b"", headers={"Status": "100", "Description": "Idle Heartbeat"})
            await asyncio.sleep(0.05)

    beats = asyncio.create_task(heartbeats())
    try:
        await add_durable(nc, stream, "deposed")
        await nc.jetstream().publish(f"{stream}.e", b"waiting")
        await wait_until_async(lambda: received.sequences == [1], timeout=5, what="the message once renewed")
    finally:
        beating = False
        await beats
        await pull.stop()


def test_heartbeats_must_fit_in_a_request_life():
    with pytest.raises(ValueError, match="heartbeats"):
        StandingPull(NatsClient(), "S", "d", Received(), expires_s=5.0, heartbeat_s=3.0)
