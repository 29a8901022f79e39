"""What every connector is: how the planner reads the fleet's pools and sets them, and the error it
raises when the fleet cannot be asked or resized (the connectors: ``kvmesh.planner.connectors``)."""

from __future__ import annotations

from typing import Protocol

from kvmesh.planner.decision import PoolSizes


class ConnectorError(RuntimeError):
    """The fleet could not be asked or resized."""


class Connector(Protocol):
    async def current(self, registered: PoolSizes) -> PoolSizes:
        """The pools as the fleet sees them (``registered``: what discovery shows)."""
        ...

    async def scale(self, target: PoolSizes) -> PoolSizes: ...
