"""Reshape a trace's arrival rate over time, so time-varying load can be studied on any trace.

A profile is a rate multiplier f(t) ≥ 0 over the replayed time axis; arrivals are moved so that the
instantaneous rate becomes f(t) times the trace's own: an arrival at (speed-up adjusted) time s moves
to the t with ∫₀ᵗ f = s. Each request keeps its order, shape and prefix; only when it comes changes.

    sine:period=600,amplitude=0.6     f(t) = 1 + 0.6 · sin(2πt / 600 s)        (amplitude < 1)
    sine:period=600,amplitude=0.6,phase=300
                                      f(t) = 1 + 0.6 · sin(2π(t + 300 s) / 600 s): shifted by 300 s
    step:at=120,factor=2              f(t) = 1 before 120 s, 2 after
    pulse:at=30,for=60,factor=2       f(t) = 2 from 30 s for 60 s, 1 before and after (an overload)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.common.runtime.config import ConfigError

PROFILES = ("sine", "step", "pulse")


@dataclass(frozen=True)
class ArrivalProfile:
    """``cumulative(t)`` = ∫₀ᵗ f; strictly increasing, so arrivals keep their order."""

    description: str
    cumulative: Callable[[float], float]
    rate_factor: Callable[[float], float]

    def warp_ms(self, time_ms: float) -> float:
        """The new arrival time of an arrival the unshaped replay puts at ``time_ms``."""
        target = time_ms / 1000.0
        low, high = 0.0, max(1.0, target)
        while self.cumulative(high) < target:
            high *= 2
        for _ in range(100):
            middle = (low + high) / 2
            if self.cumulative(middle) < target:
                low = middle
            else:
                high = middle
            if high - low < 1e-7:
                break
        return high * 1000.0


def parse_arrival_profile(text: str) -> ArrivalProfile | None:
    """``""`` (none) or ``kind:key=value,...``; raises ConfigError with what is wrong."""
    if not text:
        return None
    kind, _, raw = text.partition(":")
    try:
        params = {k.strip(): float(v) for k, v in (item.split("=", 1) for item in raw.split(",") if item.strip())}
    except ValueError as exc:
        raise ConfigError(f"--arrival-profile {text!r}: expected kind:key=number,... ({exc})") from exc
    if kind == "sine":
        period, amplitude = params.get("period", 600.0), params.get("amplitude", 0.5)
        phase = params.get("phase", 0.0)
        if period <= 0 or not 0 <= amplitude < 1:
            raise ConfigError("--arrival-profile sine: period must be positive and 0 <= amplitude < 1")
        omega = 2 * math.pi / period
        return ArrivalProfile(
            text,
            lambda t: t + amplitude / omega * (math.cos(omega * phase) - math.cos(omega * (t + phase))),
            lambda t: 1 + amplitude * math.sin(omega * (t + phase)),
        )
    if kind == "step":
        at, factor = params.get("at", 0.0), params.get("factor", 2.0)
        if at < 0 or factor <= 0:
            raise ConfigError("--arrival-profile step: at must be >= 0 and factor positive")
        return ArrivalProfile(
            text,
            lambda t: t if t <= at else at + factor * (t - at),
            lambda t: 1.0 if t < at else factor,
        )
    if kind == "pulse":
        at, length, factor = params.get("at", 0.0), params.get("for", 60.0), params.get("factor", 2.0)
        if at < 0 or length <= 0 or factor <= 0:
            raise ConfigError("--arrival-profile pulse: at must be >= 0, for and factor positive")
        end = at + length

        def cumulative(t: float) -> float:
            if t <= at:
                return t
            if t <= end:
                return at + factor * (t - at)
            return at + factor * length + (t - end)

        return ArrivalProfile(text, cumulative, lambda t: factor if at <= t < end else 1.0)
    raise ConfigError(f"--arrival-profile: unknown kind {kind!r}; choose one of {', '.join(PROFILES)}")
