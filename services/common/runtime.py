"""Running a service process: asyncio loop, clean shutdown on SIGINT / SIGTERM, NATS connection."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable

import nats
import structlog
from nats.aio.client import Client as NatsClient

log = structlog.get_logger(__name__)


async def connect_nats(url: str, name: str, connect_timeout: float = 10.0) -> NatsClient:
    """Connect with reconnects enabled; a clear error when the server is not there at all."""
    client: list[NatsClient] = []

    async def on_disconnect() -> None:
        if client and (client[0].is_closed or client[0].is_draining):
            return  # we are closing it ourselves
        log.warning("NATS disconnected", url=url)

    async def on_reconnect() -> None:
        log.info("NATS reconnected", url=url)

    async def on_error(error: Exception) -> None:
        # nats-py would print a traceback per failed reconnect attempt; one line says enough
        if not (client and client[0].is_closed):
            log.warning("NATS error", url=url, error=f"{type(error).__name__}: {error}")

    try:
        nc = await nats.connect(
            url,
            name=name,
            connect_timeout=connect_timeout,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            error_cb=on_error,
        )
    except Exception as exc:
        raise SystemExit(f"{name}: cannot connect to NATS at {url}: {exc}") from exc
    client.append(nc)
    return nc


def run_until_signalled(serve: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``serve(stop_event)``; SIGINT / SIGTERM set the event and ``serve`` shuts down cleanly."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)

    asyncio.run(main())


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel background tasks and wait until they have finished unwinding (None entries skipped)."""
    pending = [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
