"""How the planner's decisions reach the fleet.

``local``: the ``kvmesh up`` supervisor, over NATS request/reply on ``kvmesh.<ns>.planner.scale``
(JSON ``{"aggregated": N}`` sets the pool; ``{}`` asks its size; the answer is ``{"aggregated": n}``).
``no-operation``: nothing is changed; the decisions are only logged and recorded.
(The replay has its own, virtual one: ``kvmesh.replay.fleet``.)
"""

from __future__ import annotations

import json
from typing import Protocol

import nats.errors
from nats.aio.client import Client as NatsClient

from kvmesh.common import names
from kvmesh.planner.planner import PoolSizes

CONNECTORS = ("local", "no-operation")


class ConnectorError(RuntimeError):
    """The fleet could not be asked or resized."""


class Connector(Protocol):
    async def current(self, registered: PoolSizes) -> PoolSizes:
        """The pools as the fleet sees them (``registered``: what discovery shows)."""
        ...

    async def scale(self, target: PoolSizes) -> PoolSizes: ...


class NoOperation:
    async def current(self, registered: PoolSizes) -> PoolSizes:
        return registered

    async def scale(self, target: PoolSizes) -> PoolSizes:
        return target


class LocalSupervisor:
    """Asks ``kvmesh up --planner``'s supervisor; it counts the workers it started, registered or not."""

    def __init__(self, nc: NatsClient, namespace: str, timeout: float = 5.0) -> None:
        self._nc = nc
        self._subject = names.planner_scale_subject(namespace)
        self._timeout = timeout

    async def _ask(self, body: dict[str, int]) -> PoolSizes:
        try:
            reply = await self._nc.request(self._subject, json.dumps(body).encode(), timeout=self._timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise ConnectorError(
                f"no kvmesh up supervisor answers on {self._subject} (is `kvmesh up --planner` running?)"
            ) from exc
        try:
            return PoolSizes(aggregated=int(json.loads(reply.data)["aggregated"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConnectorError(f"bad answer from the supervisor: {reply.data[:200]!r}") from exc

    async def current(self, registered: PoolSizes) -> PoolSizes:
        return await self._ask({})

    async def scale(self, target: PoolSizes) -> PoolSizes:
        return await self._ask({"aggregated": target.aggregated})


def make_connector(name: str, nc: NatsClient, namespace: str) -> Connector:
    if name == "local":
        return LocalSupervisor(nc, namespace)
    if name == "no-operation":
        return NoOperation()
    raise ValueError(f"unknown connector {name!r}; choose one of {', '.join(CONNECTORS)}")
