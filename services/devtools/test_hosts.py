"""Test hosts: network namespaces joined by a bridge, for running the mesh across "machines" on one
(a developer tool for tests and drills, not a service; it needs root and iproute2).

Each host is a network namespace of its own with one interface, ``eth0``, and one address from a
private /24 used only inside these namespaces. The hosts' interfaces are joined by a bridge that
lives in a namespace of its own, never the root namespace, and no namespace has a route out: what
the hosts send reaches the other hosts and nothing else. A process runs on a host through
``ip netns exec``; a thread of this process joins a host's namespace with :func:`in_namespace` (the
network namespace belongs to a thread), so a test can be a client on a host without a subprocess.
Not a gRPC client, though: gRPC makes its connections on threads of its own, shared by the whole
process and left in the namespace where they were born, so such a thread's gRPC calls may leave from
another host or from none. gRPC checks run in a process started on the host (a child of a thread in
the namespace is born there; see ``index_truth.settle_in_fresh_process``, decision 69).
A host's outgoing connections draw their ports from :data:`EPHEMERAL_PORTS`, below the fixed ports
services listen on, so no connection takes a port before its service binds it.

:meth:`TestHosts.close` kills every process on every host and deletes every namespace; it runs on
leaving the ``with`` block, also when the body fails, and :func:`remove_stale` deletes what a run
killed before it could clean up left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PREFIX = "kvmt"  # every namespace this tool makes starts so; the creating pid follows
CLONE_NEWNET = 0x40000000
# A private /24 that nothing on the machine uses: the hosts' addresses are never seen outside them.
DEFAULT_SUBNET = "10.213.77"
# The ports a host's outgoing connections draw from. Linux's default, 32768-60999, covers the fixed
# gRPC ports services listen on (50051 and up), so a worker's connection to NATS could take the port
# another worker on the same host was about to bind (a slow CI run lost a drill so: 50072 "in use").
# Stopping at 49151, where IANA's dynamic range begins, leaves every fixed port at 49152 and above,
# and those below 32768, to the services.
EPHEMERAL_PORTS = (32768, 49151)


class TestHostsError(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2) or a command on them failed."""


def _ip(*args: str) -> str:
    try:
        result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise TestHostsError("iproute2's `ip` is not installed") from exc
    if result.returncode != 0:
        raise TestHostsError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result.stdout


def usable() -> str | None:
    """None where test hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces)"
    name = f"{PREFIX}probe{os.getpid()}"
    try:
        _ip("netns", "add", name)
        _ip("netns", "del", name)
    except TestHostsError as exc:
        return str(exc)
    return None


def namespace_pids(namespace: str) -> list[int]:
    try:
        return [int(pid) for pid in _ip("netns", "pids", namespace).split()]
    except TestHostsError:
        return []


def remove_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone (killed before it cleaned up)."""
    removed = []
    for line in _ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(rf"{PREFIX}(\d+)-\w+", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            for pid in namespace_pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(TestHostsError):
                _ip("netns", "del", name)
            removed.append(name)
    return removed


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    port: str  # the bridge's port for this host, in the switch namespace (down: the link is cut)


class TestHosts:
    """``names`` hosts on a bridge; ``with TestHosts([...]) as hosts: ...`` removes them afterwards."""

    __test__ = False  # a helper for tests, not a test class (pytest collects Test* names)

    def __init__(self, names: Sequence[str], subnet: str = DEFAULT_SUBNET) -> None:
        if len(set(names)) != len(names) or not 0 < len(names) < 200:
            raise ValueError("host names must be distinct, 1 to 199 of them")
        self._tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self._tag}-switch"
        self.hosts = {
            name: Host(name, f"{self._tag}-{name}", f"{subnet}.{10 + i}", f"p{i}") for i, name in enumerate(names)
        }
        self.subnet = subnet
        self._processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> TestHosts:
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts.values():
            _ip("netns", "add", host.namespace)
            # Both ends are made in the switch namespace's view; one moves straight into the host:
            # no interface of these ever exists in the root namespace.
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                host.port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host.namespace,
            )
            _ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            # /proc/sys/net is the namespace's own inside it; `sh` rather than `sysctl`, which a bare
            # machine may lack.
            low, high = EPHEMERAL_PORTS
            path = "/proc/sys/net/ipv4/ip_local_port_range"
            _ip("netns", "exec", host.namespace, "sh", "-c", f"echo '{low} {high}' > {path}")

    def routes(self, host: str) -> str:
        """The host's routing table (the /24 only: no default route, no way out)."""
        return _ip("-n", self.hosts[host].namespace, "route", "show")

    def run(
        self, host: str, argv: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host``; its output goes to ``log`` (or nowhere)."""
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
        try:
            process = subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[host].namespace, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        self._processes.append(process)
        return process

    def kill_host(self, host: str) -> int:
        """kill -9 every process on ``host`` (as a machine losing power would); returns how many."""
        pids = namespace_pids(self.hosts[host].namespace)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while namespace_pids(self.hosts[host].namespace) and time.monotonic() < deadline:
            time.sleep(0.05)
        for process in self._processes:
            with contextlib.suppress(Exception):
                process.poll()
        return len(pids)

    def cut(self, host: str) -> None:
        """Cut ``host``'s link (its processes live on, unreachable: a partition)."""
        _ip("-n", self.switch, "link", "set", self.hosts[host].port, "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[host].port, "up")

    def close(self) -> None:
        """Kill every process on the hosts and delete every namespace (safe to call twice)."""
        for host in self.hosts.values():
            for pid in namespace_pids(host.namespace):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for process in self._processes:
            with contextlib.suppress(Exception):
                process.kill()
                process.wait(timeout=5)
        for namespace in [*(h.namespace for h in self.hosts.values()), self.switch]:
            with contextlib.suppress(TestHostsError):
                _ip("netns", "del", namespace)

    def existing(self) -> list[str]:
        """This instance's namespaces that exist now (empty after :meth:`close`)."""
        listed = {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}
        return sorted(listed & {self.switch, *(h.namespace for h in self.hosts.values())})

    def in_namespace(self, host: str, coroutine: Callable[[], Awaitable[T]]) -> T:
        """Run ``coroutine()`` to its end on a new event loop in a thread that has joined ``host``'s
        network namespace: every socket it opens is on that host, and so is every process it starts.
        gRPC's connections are not (they are made on gRPC's own threads; see the module's note)."""
        return in_namespace(self.hosts[host].namespace, coroutine)


def in_namespace(namespace: str, coroutine: Callable[[], Awaitable[T]]) -> T:
    """See :meth:`TestHosts.in_namespace`."""
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
            finally:
                os.close(fd)
            result.append(asyncio.run(coroutine()))  # type: ignore[arg-type]
        except BaseException as exc:  # handed to the caller's thread
            error.append(exc)

    thread = threading.Thread(target=body, name=f"in-{namespace}")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
