"""Predict-on-route over real NATS, a real indexer, real workers and a real router: siblings that
share a new prefix meet it on the worker the first was sent to before its KV events reach the
indexer (the workers hold their events for half a second, as an engine's relay can); without the
prediction they scatter."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.integration.test_router_queue import up
from tests.support import router_generate, running, service_config

pytestmark = pytest.mark.integration
SIBLINGS = 8
WORKERS = 4


async def sibling_workers(nats_url: str, nc: NatsClient, namespace: str, *router_args: str) -> Counter[int]:
    """The worker each of a burst of siblings (a shared 512-token prefix, distinct tails) ran on."""
    common = ["--nats-url", nats_url, "--namespace", namespace, "--lease-ttl", "2"]
    indexer = service_config(IndexerConfig, [*common, "--replica-id", namespace])
    worker = service_config(WorkerConfig, [*common, "--speedup-ratio", "1", "--kv-events-flush-ms", "500"])
    # The stall guard (a queued prefill without progress for 0.25 s) and the decode-pace guard (ITL
    # over 50 ms) answer to a starved event loop, which a busy machine gives these in-process services:
    # off, so that only the prediction decides where a sibling goes.
    guards_off = ["--kv-stall-slack", "0", "--kv-itl-target-ms", "0"]
    router = service_config(RouterConfig, [*common, *guards_off, *router_args])
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(running(indexer_server.serve, indexer))
        for _ in range(WORKERS):
            await stack.enter_async_context(running(worker_server.serve, worker))
        await stack.enter_async_context(running(router_server.serve, router))
        address = await up(nc, namespace, workers=WORKERS, indexers=1)
        prefix = [7] * 512
        first = await router_generate(address, "s0", prefix + [100] * 16, 2)  # prefilled, its events held
        answers = await asyncio.gather(
            *(router_generate(address, f"s{i}", prefix + [100 + i] * 16, 2) for i in range(1, SIBLINGS))
        )
    return Counter(answer[-1].worker_id for answer in [first, *answers])


async def test_siblings_arriving_together_meet_their_prefix_on_one_worker(nats_url: str, nc: NatsClient):
    predicted = await sibling_workers(nats_url, nc, "predicted")
    assert max(predicted.values()) == SIBLINGS, predicted


async def test_without_the_prediction_siblings_scatter(nats_url: str, nc: NatsClient):
    # plain kv: the default duplicate penalty counts a prefix in flight as held and keeps them together
    args = ("--router-predicted-ttl-secs", "0", "--kv-duplicate-penalty", "0")
    unpredicted = await sibling_workers(nats_url, nc, "unpredicted", *args)
    assert len(unpredicted) >= 3, unpredicted
