"""Replicated JetStream state on a real three-node NATS cluster: every stream and bucket kvmesh makes
has three replicas there and one on a lone server; one found with fewer is raised; what cannot be
had is refused with a message that says how; a client given several URLs survives a dead first one."""

from __future__ import annotations

import asyncio
import subprocess

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.common.runtime import jetstream_state
from kvmesh.common.runtime.discovery import InstanceRecord, Registration, instances_bucket
from kvmesh.common.runtime.jetstream_metrics import JetStreamCollector
from kvmesh.common.runtime.jetstream_state import (
    REPLICAS_ENV,
    ReplicationError,
    cluster_size,
    ensure_stream,
    kvmesh_streams,
    wanted_replicas,
    when_jetstream_answers,
)
from kvmesh.common.runtime.kv_event_stream import ensure_kv_events_stream
from kvmesh.common.runtime.nats_cluster import CLUSTER_NAME, EmbeddedNatsCluster
from kvmesh.common.runtime.nats_server import EmbeddedNatsServer, find_nats_server
from kvmesh.common.runtime.ports import free_port
from kvmesh.common.runtime.process import connect_nats, nats_servers
from kvmesh.common.wire import names
from kvmesh.indexer import purge, snapshot
from kvmesh.indexer.snapshot_lock import SnapshotLock
from kvmesh.inspector import main as inspect_main
from kvmesh.planner.step_stream import JetStreamSteps
from tests.support import wait_until_async


@pytest.fixture(autouse=True)
def _no_replica_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REPLICAS_ENV, raising=False)


def test_several_urls_are_parsed_and_a_bad_one_is_named():
    assert nats_servers("nats://a:4222, nats://b:4222,") == ["nats://a:4222", "nats://b:4222"]
    with pytest.raises(SystemExit, match=r"'b:4222' .* is not a URL"):
        nats_servers("nats://a:4222,b:4222")
    with pytest.raises(SystemExit, match="no NATS server"):
        nats_servers(" , ")


async def test_every_stream_and_bucket_is_replicated_three_times_on_a_cluster(nats_cluster: EmbeddedNatsCluster):
    nc = await connect_nats(nats_cluster.url, name="test")
    try:
        assert cluster_size(nc) == 3
        assert wanted_replicas(nc) == 3
        js = nc.jetstream()
        await ensure_kv_events_stream(js)
        await instances_bucket(js)
        lock = SnapshotLock(js, "default", "me")
        assert await lock.acquire()
        await snapshot.upload(js, "default", snapshot.Snapshot(stream_sequence=1))
        async with JetStreamSteps(nc, "default"):
            pass
        states = {state.stream: state for state in await kvmesh_streams(js)}
        made = [s for s in names.jetstream_streams() if s != names.kv_stream(names.PLANNER_LEASE_BUCKET)]
        assert sorted(states) == sorted(made)
        for state in states.values():
            assert state.replicas == 3, state
            assert state.leader is not None
        for state in states.values():  # followers catch up: all three replicas current
            await wait_until_async(
                lambda s=state.stream: _all_current(js, s), timeout=10, what=f"{state.stream} fully current"
            )
    finally:
        await nc.close()


async def _started(registration: Registration) -> bool:
    try:
        await registration.start()
        return True
    except Exception:  # timed out: no leader yet
        return False


async def _all_current(js, stream: str) -> bool:
    [state] = [s for s in await kvmesh_streams(js) if s.stream == stream]
    return state.current_replicas == 3


async def test_a_stream_with_fewer_replicas_is_raised_and_an_impossible_count_refused(
    nats_cluster: EmbeddedNatsCluster, monkeypatch: pytest.MonkeyPatch
):
    nc = await connect_nats(nats_cluster.url, name="test")
    try:
        js = nc.jetstream()
        # made by an older kvmesh: one replica
        await js.add_stream(StreamConfig(name=names.KV_EVENTS_STREAM, subjects=["kvmesh.*.kv.*"], num_replicas=1))
        await ensure_kv_events_stream(js)
        info = await js.stream_info(names.KV_EVENTS_STREAM)
        assert info.config.num_replicas == 3
        monkeypatch.setenv(REPLICAS_ENV, "5")  # more than the cluster has servers
        with pytest.raises(ReplicationError, match=r"has 3 replica\(s\), kvmesh wants 5.*--jetstream-replicas"):
            await ensure_kv_events_stream(js)
        assert (await js.stream_info(names.KV_EVENTS_STREAM)).config.num_replicas == 3  # left as it was
    finally:
        await nc.close()


async def test_a_lone_server_gets_one_replica_and_refuses_three(nats_url: str, monkeypatch: pytest.MonkeyPatch):
    nc = await connect_nats(nats_url, name="test")
    try:
        js = nc.jetstream()
        assert cluster_size(nc) == 1
        await instances_bucket(js)
        [state] = await kvmesh_streams(js)
        assert state.replicas == 1
        monkeypatch.setenv(REPLICAS_ENV, "3")
        with pytest.raises(ReplicationError, match="NATS refused"):
            await ensure_stream(js, StreamConfig(name=names.KV_EVENTS_STREAM, subjects=["kvmesh.*.kv.*"]))
    finally:
        await nc.close()


def _server_without_jetstream(cluster: EmbeddedNatsCluster) -> subprocess.Popen[bytes]:
    """A third server routed into ``cluster`` that runs no JetStream: the cluster has three servers
    but JetStream's meta group two peers, as while a server joins it."""
    args = cluster.nodes[0].server_args
    routes = args[args.index("--routes") + 1]
    cluster_args = ["--cluster_name", CLUSTER_NAME, "--cluster", f"nats://127.0.0.1:{free_port()}", "--routes", routes]
    return subprocess.Popen(
        [str(find_nats_server()), "-a", "127.0.0.1", "-p", str(free_port()), "--server_name", "plain", *cluster_args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_replicas_a_cluster_has_servers_for_are_waited_for_until_jetstream_can_place_them(
    monkeypatch: pytest.MonkeyPatch,
):
    """A cluster whose third server has not joined JetStream's meta group yet refuses to place three
    replicas ("no suitable peers"), though its servers gossip three URLs (an indexer died so in a CI
    drill). That is asked again until the peer joins; a peer that never joins is refused in the end."""
    cluster = await EmbeddedNatsCluster(2).start()
    plain = _server_without_jetstream(cluster)
    third: EmbeddedNatsServer | None = None
    clients: list[NatsClient] = []

    async def three_gossiped() -> bool:  # a client reads the cluster's size from its first INFO
        clients.append(await connect_nats(cluster.nodes[0].url, name="test"))
        return cluster_size(clients[-1]) == 3

    try:
        await wait_until_async(three_gossiped, timeout=30, what="three servers gossiped")
        js = clients[-1].jetstream()
        config = StreamConfig(name=names.KV_EVENTS_STREAM, subjects=["kvmesh.*.kv.*"])
        monkeypatch.setattr(jetstream_state, "JETSTREAM_WAIT_S", 1.0)
        with pytest.raises(ReplicationError, match=r"no suitable peers.*asked for 1 s"):
            await ensure_stream(js, config)
        monkeypatch.setattr(jetstream_state, "JETSTREAM_WAIT_S", 60.0)
        waiting = asyncio.ensure_future(ensure_stream(js, config))
        third = EmbeddedNatsServer(server_args=[*cluster.nodes[1].server_args])
        third.server_args[third.server_args.index("--server_name") + 1] = "n3"
        third.server_args[third.server_args.index("--cluster") + 1] = f"nats://127.0.0.1:{free_port()}"
        await third.start(timeout=30)
        info = await asyncio.wait_for(waiting, 60)
        assert info.config.num_replicas == 3
    finally:
        for client in clients:
            await client.close()
        plain.kill()
        plain.wait()
        if third is not None:
            third.stop()
        cluster.stop()


async def test_a_stream_just_made_is_asked_again_while_a_server_does_not_know_it(nats_url: str):
    """In a cluster a server can answer "stream not found" for a stream another has just made (an
    indexer died so in CI reading the discovery bucket as it started). With ``made`` that is asked
    again; without, it is the error it says."""
    nc = await connect_nats(nats_url, name="test")
    try:
        js = nc.jetstream()
        asked = 0

        async def stream_appearing_on_third_ask():
            nonlocal asked
            asked += 1
            if asked == 3:  # the stream becomes known between two asks of the second call
                await js.add_stream(StreamConfig(name="LATE", subjects=["late.>"]))
            return await js.stream_info("LATE")

        with pytest.raises(nats.js.errors.NotFoundError):
            await when_jetstream_answers(stream_appearing_on_third_ask, "late stream")
        assert asked == 1
        info = await when_jetstream_answers(stream_appearing_on_third_ask, "late stream", made=True)
        assert info.config.name == "LATE" and asked == 3
    finally:
        await nc.close()


async def test_a_client_given_the_cluster_connects_past_a_dead_first_server(nats_cluster: EmbeddedNatsCluster):
    first = await connect_nats(nats_cluster.url, name="test")
    await instances_bucket(first.jetstream())  # the mesh's state exists before a server dies
    await first.close()
    nats_cluster.nodes[0].kill()
    nc = await connect_nats(nats_cluster.url, name="test", first_connect_timeout=10)
    try:
        assert nc.connected_url.port != nats_cluster.nodes[0].port
        # Where the dead server led the bucket, the two left elect a new leader (seconds); then they
        # hold the replicated state: a record can be registered.
        registration = Registration(nc.jetstream(timeout=1), InstanceRecord("worker", 7, "127.0.0.1:1"))
        await wait_until_async(lambda: _started(registration), timeout=30, what="a registration on two of three")
        [state] = await when_jetstream_answers(lambda: kvmesh_streams(nc.jetstream()), "stream states")
        assert state.replicas == 3 and state.leader in ("n2", "n3")
        await registration.stop()
    finally:
        await nc.close()


async def test_the_snapshot_lock_asked_for_without_a_majority_is_taken_once_it_returns(
    nats_cluster: EmbeddedNatsCluster,
):
    nc = await connect_nats(nats_cluster.nodes[0].url, name="test")
    try:
        lock = SnapshotLock(nc.jetstream(timeout=1), "default", "me")
        assert await lock.acquire()  # the bucket exists
        await lock.release()
        for node in nats_cluster.nodes[1:]:
            node.kill()
        # Asked while no leader can be elected: it waits, and its create then meets a stream still
        # electing its leader (a CI run's "no responders"), or a leader that lost its majority and
        # holds the timed-out create pending (refused as a wrong last sequence while the key reads
        # deleted), or, where that create committed, its own key.
        acquiring = asyncio.create_task(lock.acquire())
        await asyncio.gather(*(node.restart() for node in nats_cluster.nodes[1:]))
        assert await asyncio.wait_for(acquiring, timeout=jetstream_state.JETSTREAM_WAIT_S)
        assert lock.held
        await lock.release()
        other = SnapshotLock(nc.jetstream(), "default", "other")
        assert await other.acquire()  # released: nothing of "me" is left behind
        await other.release()
    finally:
        await nc.close()


async def test_inspect_and_metrics_show_replicas_leader_and_lag(
    nats_cluster: EmbeddedNatsCluster, capsys: pytest.CaptureFixture[str]
):
    nc = await connect_nats(nats_cluster.url, name="test")
    try:
        js = nc.jetstream()
        await ensure_kv_events_stream(js)
        # a stream just made on a cluster answers publishes once its leader is placed
        await when_jetstream_answers(lambda: js.publish("kvmesh.default.kv.1", b"x"), "a first event")
        collector = JetStreamCollector()
        collector.states = await kvmesh_streams(js)
        registry = CollectorRegistry()
        registry.register(collector)
        exported = generate_latest(registry).decode()
        leader = collector.states[0].leader
    finally:
        await nc.close()
    assert f'kvmesh_jetstream_replicas{{stream="{names.KV_EVENTS_STREAM}"}} 3.0' in exported
    assert f'kvmesh_jetstream_leader{{server="{leader}",stream="{names.KV_EVENTS_STREAM}"}} 1.0' in exported
    assert "kvmesh_jetstream_follower_lag{" in exported
    assert await asyncio.to_thread(inspect_main, ["jetstream", "--nats-url", nats_cluster.url]) == 0
    shown = capsys.readouterr().out
    assert "NATS cluster of 3 server(s)" in shown
    assert f"{names.KV_EVENTS_STREAM}: 3 replica(s)" in shown and f"leader {leader}" in shown
    assert "follower n" in shown and "lag " in shown


async def test_a_cluster_whose_drawn_port_is_taken_before_it_binds_draws_again(monkeypatch: pytest.MonkeyPatch):
    """A port is found free before its node binds it; one bound by something else in between (seen
    in the default suite: a node's route port) costs a fresh draw of every port, not the start."""
    import socket

    from kvmesh.common.runtime import nats_cluster, ports

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", ports.free_port()))
        squatter.listen()
        taken = squatter.getsockname()[1]
        draws = iter([taken])  # the first draw (n1's route port) is the squatter's; then real ones
        monkeypatch.setattr(nats_cluster, "free_port", lambda host: next(draws, None) or ports.free_port(host))
        cluster = nats_cluster.EmbeddedNatsCluster(size=3)
        assert f"nats://127.0.0.1:{taken}" in cluster.nodes[0].server_args
        try:
            await cluster.start(timeout=30)
            assert all(f"nats://127.0.0.1:{taken}" not in node.server_args for node in cluster.nodes)
            # the failed attempt's other waits were cancelled, not left probing stopped servers
            assert not [t for t in asyncio.all_tasks() if "wait_healthy" in repr(t.get_coro())]
            nc = await connect_nats(cluster.url, name="test")
            await nc.close()
        finally:
            cluster.stop()


async def test_no_purge_while_the_server_cannot_list_a_replicas_durable(nats_cluster: EmbeddedNatsCluster):
    """Behind a partition a replica's durable can be out of the stream's reach: the server lists it
    as missing, and a purge without its ack floor would drop events that replica has not read."""
    namespace = "unlisted"
    subject = names.kv_events_wildcard(namespace)
    nc = await connect_nats(nats_cluster.url, name="test")
    try:
        js = nc.jetstream()
        await ensure_kv_events_stream(js)
        for i in range(5):  # the first waits out the new stream's leader election (seen under load)
            event = f"event {i}".encode()
            await when_jetstream_answers(
                lambda event=event: js.publish(names.kv_events_subject(namespace, 1), event), "an event"
            )
        durable = names.indexer_durable_name(namespace, "far")
        config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.ALL, filter_subject=subject, num_replicas=1)
        await js.add_consumer(names.KV_EVENTS_STREAM, config)
        listed: list[list[str]] = []

        async def listed_in_full() -> bool:
            try:  # a consumer just created is listed as missing until its leader is placed,
                listed.append([d.name for d in await purge.durables_following(nc, namespace)])
            except purge.IncompleteConsumerList:
                return False
            # and, under load, left out of a complete list until its assignment reaches the stream's leader
            return bool(listed[-1])

        await wait_until_async(listed_in_full, timeout=30, what="the new durable listed in full")
        assert listed[-1] == [durable]
        leader = (await js.consumer_info(names.KV_EVENTS_STREAM, durable)).cluster.leader
        held = next(node for i, node in enumerate(nats_cluster.nodes) if f"n{i + 1}" == leader)
        held.stop()  # the durable's only replica: it has read nothing

        async def listed_as_missing() -> bool:
            try:
                await purge.durables_following(nc, namespace)
            except purge.IncompleteConsumerList:
                return True
            except (TimeoutError, nats.errors.Error):
                pass  # the cluster electing new leaders
            return False

        await wait_until_async(listed_as_missing, timeout=60, what="the durable listed as missing")
        assert await purge.purge_covered(nc, namespace, snapshot_sequence=5) == 0
        held_events: list[int] = []

        async def stream_answers() -> bool:
            try:  # the stream may still be electing a leader on the two nodes left
                info = await js.stream_info(names.KV_EVENTS_STREAM, subjects_filter=subject)
            except (TimeoutError, nats.errors.Error):
                return False
            held_events.append(sum((info.state.subjects or {}).values()))
            return True

        await wait_until_async(stream_answers, timeout=60, what="the stream's info")
        assert held_events[-1] == 5
    finally:
        await nc.close()
