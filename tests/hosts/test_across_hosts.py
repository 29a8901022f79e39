"""The mesh across hosts: three network-namespace hosts, each with a NATS cluster node, an indexer
replica, a router replica and mock workers, two with a frontend; the official openai client on a
fourth host sends streaming requests over both frontends. Every service binds and advertises its
host's address. The hosts have no route out and are removed afterwards, also when a test fails."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest

from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.jetstream_state import kvmesh_streams
from kvmesh.common.runtime.process import connect_nats
from kvmesh.devtools import host_mesh
from kvmesh.devtools.host_mesh import HostMesh
from kvmesh.devtools.index_truth import settle_in_fresh_process
from kvmesh.devtools.test_hosts import EPHEMERAL_PORTS, TestHosts, namespace_pids
from tests.hosts.conftest import CLIENT, require_hosts
from tests.support import wait_until

pytestmark = pytest.mark.integration


def test_the_mesh_serves_across_hosts_and_every_service_advertises_its_host(host_mesh: HostMesh):
    hosts = host_mesh.hosts
    addresses = {hosts[h].address for h in host_mesh.layout.mesh_hosts}
    assert "default" not in hosts.routes(CLIENT)  # no way out of the hosts

    async def on_the_client_host() -> None:
        clients = [
            openai.AsyncOpenAI(base_url=api, api_key="unused", max_retries=0, timeout=60) for api in host_mesh.apis()
        ]

        async def ask(i: int) -> int:
            answer = await clients[i % 2].chat.completions.create(
                model="kvmesh-tiny",
                messages=[{"role": "user", "content": f"shared context {i % 3} " * 30}],
                max_tokens=16,
            )
            return answer.usage.completion_tokens

        assert await asyncio.gather(*(ask(i) for i in range(24))) == [16] * 24
        for client in clients:
            await client.close()
        nc = await connect_nats(host_mesh.nats_url, name="test")
        try:
            for component, count in host_mesh.expected_counts().items():
                watcher = DiscoveryWatcher(nc.jetstream(), "default", component)
                await watcher.start()
                records = watcher.instances()
                assert len(records) == count
                # bound and advertised on the hosts' own addresses, spread over all three
                assert {r.address.rsplit(":", 1)[0] for r in records} == addresses, component
                await watcher.stop()
            states = await kvmesh_streams(nc.jetstream())
            assert states and all(s.replicas == 3 for s in states)
        finally:
            await nc.close()
        # gRPC from a process born on this host: this thread's own gRPC would connect from where
        # gRPC's threads were born, maybe another namespace (decision 69)
        settled = await settle_in_fresh_process(host_mesh.nats_url, wait=10)
        assert len(settled) == host_mesh.expected_counts()["indexer"], settled
        assert settled.ok(), f"indexer replicas not converged within 10 s: {settled}"

    hosts.in_namespace(CLIENT, on_the_client_host)


def test_the_hosts_are_removed_when_the_test_body_fails():
    require_hosts()
    made: list[str] = []
    with pytest.raises(RuntimeError, match="the body failed"), TestHosts(["a", "b"]) as hosts:
        made = hosts.existing()
        hosts.run("a", ["sleep", "600"])
        # `ip netns exec` enters the namespace, then execs: wait until it has
        wait_until(lambda: bool(namespace_pids(hosts["a"].namespace)), timeout=10, what="a process on host a")
        raise RuntimeError("the body failed")
    assert len(made) == 3  # two hosts and the switch
    assert hosts.existing() == []


def test_a_hosts_outgoing_connections_never_take_a_port_a_mesh_service_listens_on():
    require_hosts()
    low, high = EPHEMERAL_PORTS
    fixed = [host_mesh.NATS_PORT, host_mesh.ROUTE_PORT, host_mesh.HTTP_PORT, host_mesh.ROUTER_PORT]
    fixed += [host_mesh.INDEXER_PORT, *range(host_mesh.WORKER_PORT, host_mesh.WORKER_PORT + 8)]
    assert not [p for p in fixed if low <= p <= high]
    with TestHosts(["a"]) as hosts:

        async def connect_on_a() -> tuple[str, list[int]]:
            with open("/proc/sys/net/ipv4/ip_local_port_range") as setting:  # this namespace's own
                configured = setting.read()
            # Linux draws a connection's port from an offset hashed on its destination, then counts
            # up: 40 destinations make 40 independent draws, and were the machine's 32768-60999 in
            # force, all 40 would land at or below `high` about once in 10^9 runs.
            listeners = [socket.create_server((hosts["a"].address, 0)) for _ in range(40)]
            sockets = [socket.create_connection(lst.getsockname(), timeout=10) for lst in listeners]
            try:
                return configured, [s.getsockname()[1] for s in sockets]
            finally:
                for s in [*sockets, *listeners]:
                    s.close()

        configured, drawn = hosts.in_namespace("a", connect_on_a)
    assert configured.split() == [str(low), str(high)]
    assert len(drawn) == 40
    assert all(low <= port <= high for port in drawn), sorted(drawn)[-5:]
