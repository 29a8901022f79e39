"""How the frontend reaches the routers: discovered replicas (or one fixed address), used in turn."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import grpc

from kvmesh.common.discovery import DiscoveryWatcher
from kvmesh.common.grpc_server import insecure_channel
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2_grpc


class NoRouterError(RuntimeError):
    """No router replica is registered."""


class RouterClient:
    """Streams ``Router.Generate`` from a router replica, spreading requests over the replicas."""

    def __init__(self, watcher: DiscoveryWatcher | None = None, fixed_address: str | None = None) -> None:
        if watcher is None and fixed_address is None:
            raise ValueError("need a discovery watcher or a fixed router address")
        self._watcher = watcher
        self._fixed = fixed_address
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._counter = itertools.count()

    def addresses(self) -> list[str]:
        if self._fixed:
            return [self._fixed]
        assert self._watcher is not None
        return sorted(r.address for r in self._watcher.instances())

    def pick(self, avoid: frozenset[str] = frozenset()) -> str:
        """The next router address in turn, skipping ``avoid`` while others exist."""
        addresses = self.addresses()
        usable = [a for a in addresses if a not in avoid]
        if not usable:
            raise NoRouterError("no router is available" if not addresses else "every router replica failed")
        return usable[next(self._counter) % len(usable)]

    def generate(
        self, request: common_pb2.PreprocessedRequest, address: str
    ) -> AsyncIterator[common_pb2.GenerateOutput]:
        """The stream of ``Router.Generate`` at ``address``; raises ``grpc.aio.AioRpcError``."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = insecure_channel(address)
        return router_pb2_grpc.RouterStub(channel).Generate(request)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
