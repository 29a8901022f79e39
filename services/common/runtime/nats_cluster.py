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
        # every port of the cluster distinct: each is found free before any server binds it, so two
        # draws may return the same one (CI once saw a node's route port already bound)
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

        self.nodes = [
            EmbeddedNatsServer(
                host=host,
                port=distinct_port(),
                store_dir=str(Path(self.store_dir) / f"n{i + 1}"),
                server_args=[*cluster_args(i), *(server_args or [])],
                credentials=credentials,
            )
            for i in range(size)
        ]
        for node in self.nodes:
            Path(node.store_dir).mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated: what ``--nats-url`` takes."""
        return ",".join(node.url for node in self.nodes)

    async def start(self, timeout: float = 30.0) -> EmbeddedNatsCluster:
        for node in self.nodes:
            node.start_process()
        try:
            await asyncio.gather(*(node.wait_healthy(timeout) for node in self.nodes))
        except NatsServerError:
            self.stop()
            raise
        return self

    def exited(self) -> list[EmbeddedNatsServer]:
        """The nodes whose process has exited (for a supervisor to restart)."""
        return [node for node in self.nodes if node.exited()]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)
