"""An embedded NATS cluster with JetStream: several ``nats-server`` children joined by cluster routes,
for ``kvmesh up --nats-cluster N`` (the failure modes of a replicated mesh on one machine) and for the
tests and drills that need a cluster.

Each node is an :class:`EmbeddedNatsServer` with a name, a client port, a route port and its own
store; every node is given every node's route URL (a node ignores the route to itself). The cluster is
ready when every node answers JetStream requests, which needs the JetStream meta group to have
elected a leader, hence a quorum of nodes up.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from kvmesh.common.runtime.nats_auth import NatsCredentials
from kvmesh.common.runtime.nats_server import EmbeddedNatsServer, NatsServerError
from kvmesh.common.runtime.ports import free_port

CLUSTER_NAME = "kvmesh"
START_ATTEMPTS = 3


async def _all_healthy(nodes: list[EmbeddedNatsServer], timeout: float) -> None:
    """Waits for every node to be healthy; the first to fail cancels the others' waits (``gather``
    would leave them probing servers that are about to be stopped) and its error is raised."""
    waits = [asyncio.ensure_future(node.wait_healthy(timeout)) for node in nodes]
    try:
        for finished in asyncio.as_completed(waits):
            await finished
    finally:
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


class EmbeddedNatsCluster:
    """``size`` ``nats-server -js`` children on ``host``, routed to each other (``size`` 1: one server,
    no routes); :meth:`stop` ends them all and removes the stores it made."""

    def __init__(
        self,
        size: int = 3,
        host: str = "127.0.0.1",
        store_dir: str | None = None,
        server_args: list[str] | None = None,
        credentials: NatsCredentials | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a NATS cluster needs at least one node")
        self.size = size
        self.host = host
        self._own_store = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="kvmesh-nats-cluster-")
        self._server_args = list(server_args or [])
        self._credentials = credentials
        self.nodes = self._make_nodes()

    def _make_nodes(self) -> list[EmbeddedNatsServer]:
        """The nodes on freshly drawn ports, every one distinct: each is found free before any server
        binds it, so two draws may return the same one (CI once saw a node's route port bound)."""
        host, size = self.host, self.size
        taken: set[int] = set()

        def distinct_port() -> int:
            while (port := free_port(host)) in taken:
                pass
            taken.add(port)
            return port

        route_ports = [distinct_port() for _ in range(size)]
        routes = ",".join(f"nats://{host}:{port}" for port in route_ports)

        def cluster_args(i: int) -> list[str]:
            if size == 1:  # a lone server: no routes to anyone
                return []
            name = ["--server_name", f"n{i + 1}", "--cluster_name", CLUSTER_NAME]
            return [*name, "--cluster", f"nats://{host}:{route_ports[i]}", "--routes", routes]

        nodes = [
            EmbeddedNatsServer(
                host=host,
                port=distinct_port(),
                store_dir=str(Path(self.store_dir) / f"n{i + 1}"),
                server_args=[*cluster_args(i), *self._server_args],
                credentials=self._credentials,
            )
            for i in range(size)
        ]
        for node in nodes:
            Path(node.store_dir).mkdir(parents=True, exist_ok=True)
        return nodes

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated: what ``--nats-url`` takes."""
        return ",".join(node.url for node in self.nodes)

    async def start(self, timeout: float = 30.0) -> EmbeddedNatsCluster:
        """Starts every node and waits for them to be healthy. A port found free and then bound by
        something else before its node bound it (seen in the default suite) costs a fresh draw of
        every port, up to ``START_ATTEMPTS`` times; :attr:`url` is the cluster's once this returns."""
        attempt = 1
        while True:
            for node in self.nodes:
                node.start_process()
            try:
                await _all_healthy(self.nodes, timeout)
                return self
            except NatsServerError as exc:
                for node in self.nodes:
                    node.stop()
                if "address already in use" not in str(exc) or attempt == START_ATTEMPTS:
                    self.stop()
                    raise
                for node in self.nodes:  # a fresh start: no stores naming the old ports
                    shutil.rmtree(node.store_dir, ignore_errors=True)
                self.nodes = self._make_nodes()
                attempt += 1

    def exited(self) -> list[EmbeddedNatsServer]:
        """The nodes whose process has exited (for a supervisor to restart)."""
        return [node for node in self.nodes if node.exited()]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)
