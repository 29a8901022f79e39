"""What every connector is: how the planner reads the fleet's pools and sets them, and the error it
raises when the fleet cannot be asked or resized (the connectors: ``kvmesh.planner.connectors``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from kvmesh.planner.decision import POOLS, PoolSizes


class ConnectorError(RuntimeError):
    """The fleet could not be asked or resized."""


class Connector(Protocol):
    async def current(self, registered: PoolSizes) -> PoolSizes:
        """The pools as the fleet sees them (``registered``: what discovery shows)."""
        ...

    async def scale(self, target: PoolSizes) -> PoolSizes: ...


def by_pool(named: Mapping[str, str], what: str) -> dict[str, str]:
    """What a connector resizes, keyed by pool (``{"aggregated": "worker"}``, or ``{"prefill": ...,
    "decode": ...}``); ValueError naming ``what`` where none is given or a key is no pool."""
    unknown = set(named) - set(POOLS)
    if unknown or not named:
        raise ValueError(f"{what} are keyed by pool ({', '.join(POOLS)}), not {sorted(unknown)}")
    return dict(named)
