"""A kvmesh laid over test hosts (:mod:`kvmesh.devtools.test_hosts`), as an operator would lay it over
machines: every mesh host runs one node of a NATS cluster, an indexer replica, a router replica and
mock workers; some also run a frontend. Every service binds and advertises its host's address and is
given every NATS node. A developer tool for tests and drills, not a service.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.nats_server import find_nats_server
from kvmesh.common.runtime.process import connect_nats
from kvmesh.devtools.test_hosts import TestHosts

NATS_PORT = 4222
ROUTE_PORT = 6222
ROUTER_PORT = 50051
INDEXER_PORT = 50061
WORKER_PORT = 50071  # the first worker's; the next ones count up
HTTP_PORT = 8000


@dataclass
class HostMeshLayout:
    mesh_hosts: Sequence[str] = ("h1", "h2", "h3")
    frontend_hosts: Sequence[str] = ("h1", "h2")
    workers_per_host: int = 2
    lease_ttl: float = 6.0
    speedup_ratio: float = 4.0
    snapshot_threshold: int = 200  # messages in the stream before an indexer snapshots (drills check restores)
    worker_args: Sequence[str] = ()


@dataclass
class HostProcesses:
    nats: subprocess.Popen[bytes] | None = None
    services: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)


class HostMesh:
    """Starts, kills and restarts the mesh's processes host by host; a client on one of the hosts
    (:meth:`TestHosts.in_namespace`) reaches the frontends at :meth:`api`."""

    def __init__(self, hosts: TestHosts, workdir: Path, layout: HostMeshLayout | None = None) -> None:
        self.hosts = hosts
        self.workdir = workdir
        self.layout = layout or HostMeshLayout()
        self.processes = {host: HostProcesses() for host in self.layout.mesh_hosts}

    @property
    def nats_url(self) -> str:
        return ",".join(f"nats://{self.hosts[h].address}:{NATS_PORT}" for h in self.layout.mesh_hosts)

    def api(self, host: str) -> str:
        return f"http://{self.hosts[host].address}:{HTTP_PORT}/v1"

    def apis(self) -> list[str]:
        return [self.api(h) for h in self.layout.frontend_hosts]

    def log(self, host: str, what: str) -> Path:
        return self.workdir / f"{host}-{what}.log"

    # --- starting -------------------------------------------------------------------------------

    def start(self) -> None:
        for host in self.layout.mesh_hosts:
            self.start_nats(host)
        for host in self.layout.mesh_hosts:
            self.start_services(host)

    def start_nats(self, host: str) -> None:
        address = self.hosts[host].address
        routes = ",".join(f"nats://{self.hosts[h].address}:{ROUTE_PORT}" for h in self.layout.mesh_hosts)
        store = self.workdir / f"nats-{host}"
        store.mkdir(parents=True, exist_ok=True)
        argv = [
            str(find_nats_server()),
            *("-a", address, "-p", str(NATS_PORT), "-js", "-sd", str(store)),
            *("--server_name", host, "--cluster_name", "kvmesh"),
            *("--cluster", f"nats://{address}:{ROUTE_PORT}", "--routes", routes),
        ]
        self.processes[host].nats = self.hosts.run(host, argv, log=self.log(host, "nats"))

    def _service(self, host: str, name: str, module: str, *args: str) -> None:
        argv = [
            sys.executable,
            "-m",
            module,
            *("--nats-url", self.nats_url, "--namespace", "default", "--log-json", "--nats-connect-timeout", "60"),
            *args,
        ]
        self.processes[host].services[name] = self.hosts.run(host, argv, log=self.log(host, name))

    def start_services(self, host: str) -> None:
        address = self.hosts[host].address
        grpc_common = ("--host", address, "--lease-ttl", str(self.layout.lease_ttl), "--drain-timeout-secs", "3")
        self._service(
            host,
            "indexer",
            "kvmesh.indexer",
            *grpc_common,
            *("--port", str(INDEXER_PORT), "--replica-id", host),
            *("--router-snapshot-threshold", str(self.layout.snapshot_threshold), "--snapshot-check-interval", "2"),
        )
        self._service(
            host,
            "router",
            "kvmesh.router",
            *grpc_common,
            *("--port", str(ROUTER_PORT), "--router-replica-sync"),
        )
        for i in range(self.layout.workers_per_host):
            self._service(
                host,
                f"worker-{i}",
                "kvmesh.worker",
                *grpc_common,
                *("--port", str(WORKER_PORT + i), "--speedup-ratio", str(self.layout.speedup_ratio)),
                *self.layout.worker_args,
            )
        if host in self.layout.frontend_hosts:
            self._service(host, "frontend", "kvmesh.frontend", "--http-host", address, "--http-port", str(HTTP_PORT))

    def start_host(self, host: str) -> None:
        self.start_nats(host)
        self.start_services(host)

    def kill_host(self, host: str) -> None:
        self.hosts.kill_host(host)

    def kill_nats(self, host: str) -> None:
        nats = self.processes[host].nats
        if nats is not None:
            nats.kill()
            nats.wait()

    def stop_nats(self, host: str, timeout: float = 30.0) -> None:
        """A graceful stop (SIGTERM), as a rolling upgrade stops a node."""
        nats = self.processes[host].nats
        if nats is not None:
            nats.terminate()
            try:
                nats.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                nats.kill()
                nats.wait()

    def expected_counts(self) -> dict[str, int]:
        n = len(self.layout.mesh_hosts)
        return {"worker": n * self.layout.workers_per_host, "indexer": n, "router": n}

    def expected_services(self) -> dict[str, tuple[str, str]]:
        """Every registering service's advertised address: (host, service name)."""
        expected: dict[str, tuple[str, str]] = {}
        for host in self.layout.mesh_hosts:
            address = self.hosts[host].address
            expected[f"{address}:{INDEXER_PORT}"] = (host, "indexer")
            expected[f"{address}:{ROUTER_PORT}"] = (host, "router")
            for i in range(self.layout.workers_per_host):
                expected[f"{address}:{WORKER_PORT + i}"] = (host, f"worker-{i}")
        return expected

    def missing_report(self, registered: set[str], log_lines: int = 25) -> str:
        """For every service not in ``registered`` (advertised addresses): whether its process still
        runs, and the end of its log; what a failed start needs to be understood after the fact."""
        parts = []
        for address, (host, name) in self.expected_services().items():
            if address in registered:
                continue
            process = self.processes[host].services.get(name)
            status = None if process is None else process.poll()
            state = "not started" if process is None else "running" if status is None else f"exit status {status}"
            try:
                tail = self.log(host, name).read_text(errors="replace").splitlines()[-log_lines:]
            except OSError as exc:
                tail = [f"(no log: {exc})"]
            parts.append(f"--- {name} on {host} ({address}) not registered, {state}; its log ends:\n" + "\n".join(tail))
        return "\n".join(parts) or "every service registered (a frontend does not answer /health)"

    # --- checks, run by a client on one of the hosts ----------------------------------------------

    async def wait_ready(self, timeout: float = 90.0) -> None:
        """Every instance registered and every frontend answering /health."""
        nc = await connect_nats(self.nats_url, name="host-mesh-check", first_connect_timeout=timeout)
        try:
            expected = self.expected_counts()
            watchers = {c: DiscoveryWatcher(nc.jetstream(), "default", c) for c in expected}
            deadline = time.monotonic() + timeout
            for watcher in watchers.values():
                while True:
                    try:
                        await watcher.start()
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.5)
            try:
                while True:
                    counts = {c: len(w.instances()) for c, w in watchers.items()}
                    if counts == expected and await self.frontends_healthy():
                        return
                    if time.monotonic() > deadline:
                        registered = {r.address for w in watchers.values() for r in w.instances()}
                        raise TimeoutError(
                            f"host mesh not ready after {timeout} s: registered {counts}\n"
                            + self.missing_report(registered)
                        )
                    await asyncio.sleep(0.2)
            finally:
                for watcher in watchers.values():
                    await watcher.stop()
        finally:
            await nc.close()

    async def frontends_healthy(self, hosts: Sequence[str] | None = None) -> bool:
        async with httpx.AsyncClient(timeout=2.0) as client:
            for host in hosts or self.layout.frontend_hosts:
                try:
                    response = await client.get(f"http://{self.hosts[host].address}:{HTTP_PORT}/health")
                except httpx.HTTPError:
                    return False
                if response.status_code != 200:
                    return False
        return True
