"""Running a service process: asyncio loop, clean shutdown on SIGINT / SIGTERM, NATS connection."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import ssl
from collections.abc import Awaitable, Callable

import structlog
from nats.aio.client import Client as NatsClient

from kvmesh.common.runtime.nats_auth import NatsCredentials

log = structlog.get_logger(__name__)


DEFAULT_NATS_CONNECT_TIMEOUT = 5.0
PING_INTERVAL_S = 5.0
NATS_CONNECT_TIMEOUT_ENV = "KVMESH_NATS_CONNECT_TIMEOUT"


def nats_connect_timeout_default() -> float:
    """``$KVMESH_NATS_CONNECT_TIMEOUT`` where set (seconds), else 5."""
    raw = os.environ.get(NATS_CONNECT_TIMEOUT_ENV)
    try:
        return float(raw) if raw else DEFAULT_NATS_CONNECT_TIMEOUT
    except ValueError:
        raise SystemExit(f"{NATS_CONNECT_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


def nats_servers(url: str) -> list[str]:
    """The servers of a ``--nats-url``: one URL, or several separated by commas (the seeds of a
    cluster; the client learns the others from the servers and fails over among all of them)."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise SystemExit(f"no NATS server in {url!r}")
    for server in servers:
        if "://" not in server:
            raise SystemExit(f"NATS server {server!r} in {url!r} is not a URL (nats://host:port, tls://host:port)")
    return servers


async def connect_nats(
    url: str, name: str, first_connect_timeout: float | None = None, credentials: NatsCredentials | None = None
) -> NatsClient:
    """Connect, giving up after ``first_connect_timeout`` seconds (default
    :func:`nats_connect_timeout_default`) with one line that names the URL: a service or tool started
    with no NATS there fails instead of retrying forever. Once connected, reconnects are unlimited
    (a NATS restart must not take the mesh down). ``credentials``: default from the environment
    (``KVMESH_NATS_USER`` ...)."""
    timeout = nats_connect_timeout_default() if first_connect_timeout is None else first_connect_timeout
    credentials = NatsCredentials.from_environment() if credentials is None else credentials
    try:
        credentials.validate()
        auth = credentials.connect_options()
    except (ValueError, OSError, ssl.SSLError) as exc:
        raise SystemExit(f"{name}: NATS credentials: {exc}") from exc
    connected = False
    last_error: list[Exception] = []
    nc = NatsClient()

    async def on_disconnect() -> None:
        if nc.is_closed or nc.is_draining:
            return  # we are closing it ourselves
        log.warning("NATS disconnected", url=url)

    async def on_reconnect() -> None:
        log.info("NATS reconnected", url=url, server=str(nc.connected_url.netloc) if nc.connected_url else None)

    servers = nats_servers(url)
    # A refused login does not pass by retrying: once there have been as many refusals as servers named,
    # the first connect gives up at once instead of at its timeout. nats-py tries the servers in turn,
    # so by then each has had its say, where a cluster's seeds might answer differently.
    all_refused = asyncio.Event()

    async def on_error(error: Exception) -> None:
        if not connected:  # while first connecting, the one line at the end says it
            last_error.append(error)
            if sum(1 for e in last_error if _refused(e)) >= len(servers):
                all_refused.set()
            return
        # nats-py would print a traceback per failed reconnect attempt; one line says enough
        if not nc.is_closed:
            log.warning("NATS error", url=url, error=f"{type(error).__name__}: {error}")

    connect = nc.connect(
        servers=servers,
        name=name,
        connect_timeout=max(0.1, min(2.0, timeout)),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        # A server behind a cut link sends no reset: nats-py's default (a ping each two minutes)
        # would keep a dead connection for minutes. Two unanswered pings 5 s apart move the client
        # to another server of the cluster.
        ping_interval=PING_INTERVAL_S,
        max_outstanding_pings=2,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
        **auth,
    )
    try:
        await _first_connect(connect, all_refused, timeout)
    except Exception as exc:  # a timeout, a refusal, or an error nats-py gave up on
        with contextlib.suppress(Exception):
            await nc.close()
        # A refused login is the error that explains the others: after it the server just drops the
        # connection, and the last attempt may have seen only that ("connection reset").
        refused = [e for e in last_error if _refused(e)]
        cause = refused[0] if refused else last_error[-1] if last_error else exc
        reason = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        hint = (
            "check the credentials (--nats-user / --nats-password, --nats-token or --nats-creds, or KVMESH_NATS_*)"
            if refused
            else "is a NATS server running there? (`kvmesh up` starts one; --nats-url or KVMESH_NATS_URL names another)"
        )
        when = "the login was refused" if all_refused.is_set() else f"within {timeout:g} s"
        raise SystemExit(f"{name}: cannot connect to NATS at {url}: {when} ({reason}); {hint}") from exc
    connected = True
    return nc


def _refused(error: Exception) -> bool:
    """Whether ``error`` is the server refusing the login (NATS's "Authorization Violation")."""
    return "authoriz" in str(error).lower()


async def _first_connect(connect: Awaitable[None], all_refused: asyncio.Event, timeout: float) -> None:
    """Await ``connect`` for at most ``timeout`` seconds, or until ``all_refused`` is set; raises
    :class:`TimeoutError` on either (``connect`` is cancelled) and whatever ``connect`` raised."""
    connecting = asyncio.ensure_future(connect)
    refusal = asyncio.ensure_future(all_refused.wait())
    try:
        await asyncio.wait((connecting, refusal), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        refusal.cancel()
    if not connecting.done():
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await connecting
        raise TimeoutError
    connecting.result()


# Set by a supervisor (``kvmesh up``) in its children's environment: the pid they must outlive not.
PARENT_PID_ENV = "KVMESH_PARENT_PID"
PARENT_CHECK_INTERVAL_S = 1.0


async def stop_when_orphaned(stop: asyncio.Event, parent_pid: int) -> None:
    """Set ``stop`` once this process's parent is no longer ``parent_pid`` (it died and the process
    was handed to init). The kernel's parent-death signal (``ending_with_parent``) does this at once
    where it is set; this check covers a parent that died before the signal was set, and a machine
    without ``setpriv``, so that no service outlives ``kvmesh up``, even one killed with -9."""
    while not stop.is_set():
        if os.getppid() != parent_pid:
            log.warning("the supervisor that started this service is gone; stopping", parent_pid=parent_pid)
            stop.set()
            return
        await asyncio.sleep(PARENT_CHECK_INTERVAL_S)


def run_until_signalled(serve: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``serve(stop_event)``; SIGINT / SIGTERM set the event and ``serve`` shuts down cleanly, as
    does the death of the supervisor named in ``$KVMESH_PARENT_PID``."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        parent = os.environ.get(PARENT_PID_ENV, "")
        watch = asyncio.create_task(stop_when_orphaned(stop, int(parent))) if parent.isdigit() else None
        try:
            await serve(stop)
        finally:
            if watch is not None:
                watch.cancel()

    if event_loop_kind() == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def event_loop_kind() -> str:
    """The event loop services run on: uvloop where it is installed (its wake-ups and callbacks cost
    less: docs/decisions/0020), unless ``KVMESH_EVENT_LOOP=asyncio`` asks for the standard one."""
    wanted = os.environ.get("KVMESH_EVENT_LOOP", "uvloop")
    if wanted not in ("uvloop", "asyncio"):
        raise SystemExit(f"KVMESH_EVENT_LOOP must be uvloop or asyncio, not {wanted!r}")
    if wanted == "uvloop" and importlib.util.find_spec("uvloop") is None:
        return "asyncio"
    return wanted
