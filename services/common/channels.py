"""One reusable gRPC channel per peer address."""

from __future__ import annotations

import grpc

from kvmesh.common.grpc_server import insecure_channel


class ChannelPool:
    """Channels by address, made on first use and reused across requests.

    Owners drop a peer's channel when discovery says the peer left, so the pool holds channels of
    live peers only (a departed peer's channel would otherwise reconnect in the background forever).
    """

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = insecure_channel(address)
        return channel

    def addresses(self) -> list[str]:
        return list(self._channels)

    async def drop(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)
