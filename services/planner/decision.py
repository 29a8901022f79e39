"""What the planner decides each interval: the pools' sizes, and the decision with what led to it
(the forecast, what the model wanted, the corrections, the SLA window's attainment)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvmesh.planner.load import LoadForecast


@dataclass(frozen=True)
class PoolSizes:
    aggregated: int = 0
    prefill: int = 0
    decode: int = 0

    @property
    def total(self) -> int:
        return self.aggregated + self.prefill + self.decode


POOLS = tuple(f.name for f in dataclasses.fields(PoolSizes))  # the pools' names, in PoolSizes' order


@dataclass(frozen=True)
class Decision:
    at_s: float
    forecast: LoadForecast
    wanted: PoolSizes  # what the model asks for this interval
    target: PoolSizes  # what the planner sets, after hysteresis
    current: PoolSizes
    predicted_ttft_ms: float
    predicted_itl_ms: float
    ttft_correction: float
    itl_correction: float
    utilisation_cap: float
    # the attainment over --attainment-window after this interval (None: nothing finished in it)
    window_attainment: float | None = None
    # the worker start-up the decision planned for: measured, else --worker-startup-secs (None: older)
    worker_startup_s: float | None = None

    @property
    def changes(self) -> bool:
        return self.target != self.current
