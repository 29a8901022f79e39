"""One reusable gRPC channel per peer address."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from kvmesh.common.rpc.grpc_server import channel_to

# How long a departed peer's channel stays open for the calls still running on it. A peer that shuts
# down cleanly deregisters first and serves its open streams for a grace period; closing the channel
# at once would cancel those streams under their callers (who see asyncio.CancelledError, not a gRPC
# status, and cannot retry elsewhere). Calls still open after this are cut.
DEPARTED_PEER_DRAIN_SECS = 600.0


class ChannelPool:
    """Channels by address, made on first use and reused across requests.

    Owners drop a peer's channel when discovery says the peer left, so the pool hands out channels of
    live peers only (a departed peer's channel would otherwise reconnect in the background forever).
    Dropping never cuts a call in flight: the channel closes once its calls have ended (or after
    :data:`DEPARTED_PEER_DRAIN_SECS`). :meth:`close` closes everything at once.
    """

    def __init__(self, drain_secs: float = DEPARTED_PEER_DRAIN_SECS) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._draining: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self._drain_secs = drain_secs

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = channel_to(address)
        return channel

    def addresses(self) -> list[str]:
        return list(self._channels)

    def draining(self) -> int:
        """Channels of departed peers still waiting for their calls to end."""
        return len(self._draining)

    async def drop(self, address: str) -> None:
        """Stop handing out ``address``'s channel; close it when its calls have ended."""
        channel = self._channels.pop(address, None)
        if channel is None:
            return
        # close(grace) waits for the channel's active calls, up to the grace, before cancelling them
        task = asyncio.create_task(channel.close(grace=self._drain_secs), name=f"drain-channel-{address}")
        self._draining[task] = channel
        task.add_done_callback(self._forget_drained)

    def _forget_drained(self, task: asyncio.Task[None]) -> None:
        self._draining.pop(task, None)

    async def close(self) -> None:
        """Close every channel now, cancelling calls still running (the owner is shutting down)."""
        channels = [*self._channels.values(), *self._draining.values()]
        draining = list(self._draining)
        self._channels, self._draining = {}, {}
        for task in draining:
            task.cancel()
        for task in draining:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for channel in channels:
            await channel.close()
