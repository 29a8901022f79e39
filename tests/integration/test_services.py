"""Service shells over real NATS and real gRPC: discovery leases, the worker and indexer servers."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import common_pb2, indexer_pb2, indexer_pb2_grpc, worker_pb2_grpc
from kvmesh.common.runtime.discovery import (
    CATCH_UP_INTERVAL_S,
    DiscoveryWatcher,
    InstanceRecord,
    Registration,
    instances_bucket,
)
from kvmesh.common.wire.hashing import local_block_hashes
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "svc"


async def watcher_for(nc: NatsClient, component: str) -> DiscoveryWatcher:
    watcher = DiscoveryWatcher(nc.jetstream(), NAMESPACE, component)
    await watcher.start()
    return watcher


async def test_a_crashed_instance_disappears_after_its_lease(nc: NatsClient):
    watcher = await watcher_for(nc, "worker")
    record = InstanceRecord("worker", 12345, "127.0.0.1:1", namespace=NAMESPACE, lease_ttl=1.0)
    registration = Registration(nc.jetstream(), record)
    await registration.start()
    try:
        await wait_until_async(lambda: watcher.get(12345) is not None, what="registration seen")
        registration._task.cancel()  # the process "crashes": no refresh, no delete
        await wait_until_async(lambda: watcher.get(12345) is None, timeout=5, what="lease expiry")
    finally:
        await watcher.stop()


async def test_most_instances_lapsing_at_once_are_held_two_leases_before_they_go(nc: NatsClient):
    # as when their NATS server is cut off: every refresh fails together, and the view must not empty
    namespace = f"mass{uuid.uuid4().hex[:8]}"  # these three alone (other tests leave records in theirs)
    watcher = DiscoveryWatcher(nc.jetstream(), namespace, "indexer")
    await watcher.start()
    records = [InstanceRecord("indexer", 500 + i, f"h:{i}", namespace=namespace, lease_ttl=1.0) for i in range(3)]
    registrations = [Registration(nc.jetstream(), record) for record in records]
    for registration in registrations:
        await registration.start()
    try:
        await wait_until_async(lambda: len(watcher.instances()) == 3, what="three registered")
        for registration in registrations[:2]:
            registration._task.cancel()  # two of three stop refreshing at once, without a delete
        await wait_until_async(lambda: watcher._mass_since is not None, timeout=5, what="the mass lapse seen")
        held_from = time.monotonic()
        assert len(watcher.instances()) == 3  # past their lease, still held
        await wait_until_async(lambda: len(watcher.instances()) == 1, timeout=10, what="the silent two dropped")
        assert time.monotonic() - held_from >= 1.5  # about two leases after the lapse was seen
        assert [r.instance_id for r in watcher.instances()] == [502]
    finally:
        await registrations[2].stop()
        await watcher.stop()


async def test_a_started_watcher_holds_an_instance_whose_record_is_being_rewritten(nc: NatsClient):
    # Every live instance rewrites its record each third of its lease. A watcher created during a
    # rewrite used to get nats-py's "nothing pending" marker before the record (about 1 start in 100
    # while a record is rewritten back to back) and started with the instance missing.
    js = nc.jetstream()
    record = InstanceRecord("indexer", 77, "h:77", namespace=NAMESPACE)
    other = Registration(js, InstanceRecord("router", 78, "h:78", namespace=NAMESPACE))
    await other.start()  # another component's key, which the watcher must not list
    bucket = await instances_bucket(js)
    rewriting = True

    async def rewrite() -> None:
        while rewriting:
            await bucket.put(record.key, record.encode())

    rewriter = asyncio.create_task(rewrite())
    missed = 0
    try:
        for _ in range(500):
            watcher = DiscoveryWatcher(js, NAMESPACE, "indexer")
            await watcher.start()
            missed += [r.instance_id for r in watcher.instances()] != [77]
            await watcher.stop()
    finally:
        rewriting = False
        await rewriter
        await other.stop()
        await bucket.delete(record.key)
    assert missed == 0, f"{missed} of 500 watchers started without the instance"


async def test_a_record_the_watch_never_delivers_is_taken_from_the_bucket(nc: NatsClient):
    # A watch whose consumer was lost (its stream changing leader under a starting cluster) delivers
    # nothing more; an instance registered after that must still join the view.
    namespace = f"lost{uuid.uuid4().hex[:8]}"
    watcher = DiscoveryWatcher(nc.jetstream(), namespace, "worker")
    await watcher.start()
    await watcher._watcher.stop()  # the watch goes silent, as a lost consumer does
    registration = Registration(nc.jetstream(), InstanceRecord("worker", 91, "h:91", namespace=namespace))
    await registration.start()
    try:
        await wait_until_async(
            lambda: watcher.get(91) is not None, timeout=CATCH_UP_INTERVAL_S + 5, what="the record caught up"
        )
        assert watcher.get(91).address == "h:91"
    finally:
        await registration.stop()
        await watcher.stop()


async def test_a_graceful_stop_deregisters_at_once(nc: NatsClient):
    watcher = await watcher_for(nc, "router")
    registration = Registration(nc.jetstream(), InstanceRecord("router", 7, "h:1", namespace=NAMESPACE))
    await registration.start()
    await wait_until_async(lambda: len(watcher.instances()) == 1, what="registered")
    await registration.stop()
    await wait_until_async(lambda: not watcher.instances(), timeout=2, what="deregistered")
    await watcher.stop()


async def test_worker_serves_generate_health_and_reflection(nats_url: str, nc: NatsClient):
    config = service_config(
        WorkerConfig, ["--nats-url", nats_url, "--namespace", NAMESPACE, "--speedup-ratio", "100", "--block-size", "16"]
    )
    watcher = await watcher_for(nc, "worker")
    async with running(worker_server.serve, config):
        await wait_until_async(lambda: len(watcher.instances()) == 1, what="worker registered")
        record = watcher.instances()[0]
        assert (record.model, record.block_size, record.role) == ("kvmesh-tiny", 16, "aggregated")
        async with grpc.aio.insecure_channel(record.address) as channel:
            request = common_pb2.PreprocessedRequest(request_id="a", model="kvmesh-tiny", token_ids=list(range(40)))
            request.stop.max_tokens = 5
            outputs = [o async for o in worker_pb2_grpc.WorkerStub(channel).Generate(request)]
            assert sum(len(o.token_ids) for o in outputs) == 5
            assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert outputs[-1].usage.prompt_tokens == 40 and outputs[-1].worker_id == record.instance_id

            request.request_id = "b"
            outputs = [o async for o in worker_pb2_grpc.WorkerStub(channel).Generate(request)]
            assert outputs[-1].usage.cached_prompt_tokens == 32

            bad = common_pb2.PreprocessedRequest(request_id="c", model="other", token_ids=[1])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [o async for o in worker_pb2_grpc.WorkerStub(channel).Generate(bad)]
            assert info.value.code() == grpc.StatusCode.NOT_FOUND

            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvmesh.v1.Worker")
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            services = await _reflected_services(channel)
            assert {"kvmesh.v1.Worker", "grpc.health.v1.Health"} <= services
    await wait_until_async(lambda: not watcher.instances(), what="worker deregistered on shutdown")
    await watcher.stop()


async def _reflected_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def requests():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async for response in stub.ServerReflectionInfo(requests()):
        return {s.name for s in response.list_services_response.service}
    return set()


async def test_indexer_answers_and_forgets_a_departed_worker(
    nats_url: str, nc: NatsClient, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(indexer_server, "MAX_QUERY_BLOCKS", 8)  # this test's longer query is refused
    worker_config = service_config(
        WorkerConfig, ["--nats-url", nats_url, "--namespace", NAMESPACE, "--speedup-ratio", "100", "--lease-ttl", "1.5"]
    )
    indexer_config = service_config(IndexerConfig, ["--nats-url", nats_url, "--namespace", NAMESPACE])
    workers = await watcher_for(nc, "worker")
    indexers = await watcher_for(nc, "indexer")
    prompt = list(range(100))
    async with running(indexer_server.serve, indexer_config):
        await wait_until_async(lambda: len(indexers.instances()) == 1, what="indexer registered")
        index_channel = grpc.aio.insecure_channel(indexers.instances()[0].address)
        index_stub = indexer_pb2_grpc.IndexerStub(index_channel)
        query = indexer_pb2.FindMatchesRequest(local_hashes=local_block_hashes(prompt, 16))

        async with running(worker_server.serve, worker_config):
            await wait_until_async(lambda: len(workers.instances()) == 1, what="worker registered")
            worker = workers.instances()[0]
            async with grpc.aio.insecure_channel(worker.address) as channel:
                request = common_pb2.PreprocessedRequest(request_id="x", token_ids=prompt)
                request.stop.max_tokens = 2
                [o async for o in worker_pb2_grpc.WorkerStub(channel).Generate(request)]

            async def indexed() -> bool:
                response = await index_stub.FindMatches(query)
                return any(w.worker_id == worker.instance_id and w.matched_blocks == 6 for w in response.workers)

            await wait_until_async(indexed, what="the worker's blocks reach the index")

            # The router's stream of queries: one message, both answered in order, the refusal
            # in-stream only for the query it concerns, and each answer what FindMatches says.
            too_long = indexer_pb2.FindMatchesRequest(local_hashes=local_block_hashes(list(range(200)), 16))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await index_stub.FindMatches(too_long)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            queries = [
                indexer_pb2.FindMatchesQuery(query_id=query_id, request=request)
                for query_id, request in ((7, query), (9, too_long), (11, query))
            ]
            stream = index_stub.FindMatchesMany()
            await stream.write(indexer_pb2.FindMatchesQueries(queries=queries))
            answers = (await stream.read()).answers
            assert [a.query_id for a in answers] == [7, 9, 11]
            assert answers[1].refused == refused.value.details() and not answers[1].response.workers
            unary = await index_stub.FindMatches(query)
            assert answers[0].response.workers == answers[2].response.workers == unary.workers
            assert not answers[0].refused
            stream.cancel()

        async def forgotten() -> bool:
            response = await index_stub.FindMatches(query)
            return all(w.worker_id != worker.instance_id or w.total_blocks == 0 for w in response.workers)

        await wait_until_async(forgotten, what="a departed worker loses its blocks")
        await index_channel.close()
    await workers.stop()
    await indexers.stop()


@pytest.mark.parametrize(("flags", "speed_class"), [((), "mock x10"), (("--speed-class", "host b"), "host b")])
async def test_a_worker_advertises_the_step_times_it_measured(nats_url: str, nc: NatsClient, flags, speed_class):
    """The mock worker times its own steps, fits the step-time model and, once it has measured steps,
    puts it into its discovery record, where routers read it. (The fit itself is tested in
    test_timing_fit; here: nothing is advertised before a step, real-time constants after, and the
    engine's speed class from the start.)"""
    from kvmesh.common.core.fleet_timing import fleet_models
    from kvmesh.common.core.timing import TimingModel, from_constants, real_time
    from kvmesh.common.core.timing_fit import TimingEvidence

    argv = [
        *("--nats-url", nats_url, "--namespace", NAMESPACE, "--speedup-ratio", "10", "--timing-advertise-secs", "0.2"),
        *flags,
    ]
    workers = await watcher_for(nc, "worker")
    async with running(worker_server.serve, service_config(WorkerConfig, argv)):
        await wait_until_async(lambda: len(workers.instances()) == 1, what="worker registered")
        assert "timing" not in workers.instances()[0].extra  # nothing measured yet
        # its speed class (docs/decisions/0062): mock engines of one speed-up share one, unless told
        assert workers.instances()[0].extra["speed_class"] == speed_class
        async with grpc.aio.insecure_channel(workers.instances()[0].address) as channel:
            for i in range(5):
                request = common_pb2.PreprocessedRequest(request_id=f"t{i}", token_ids=list(range(i, 1500 + i)))
                request.stop.max_tokens = 8
                [o async for o in worker_pb2_grpc.WorkerStub(channel).Generate(request)]
        await wait_until_async(lambda: "timing" in workers.instances()[0].extra, what="the fitted constants advertised")
        extra = workers.instances()[0].extra
        fitted = from_constants(extra["timing"])
        nominal = TimingModel().prefill_ms(1500)
        assert fitted.prefill_ms(1500) < nominal / 2  # real time at speed-up 10, not the nominal model
        # with the steps behind it, which a router pools with the other workers' (docs/decisions/0061)
        steps = TimingEvidence.from_wire(extra["timing_evidence"])
        assert steps.steps > 0
        prior = real_time(dataclasses.replace(TimingModel(), speedup_ratio=10))  # the worker's own prior
        pooled = fleet_models({"alone": steps}, prior)["alone"]
        assert pooled.prefill_ms(1500) == pytest.approx(fitted.prefill_ms(1500), rel=0.05)
