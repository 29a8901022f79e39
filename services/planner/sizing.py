"""How the model sizes the pools: the smallest that meet the targets under a forecast load (kvmesh's
queueing model), or Dynamo's throughput-per-worker shares (for comparison)."""

from __future__ import annotations

import dataclasses
import math

from kvmesh.common.core.engine_profile import EngineProfile
from kvmesh.planner import capacity
from kvmesh.planner.decision import PoolSizes
from kvmesh.planner.load import LoadForecast
from kvmesh.planner.options import PlannerOptions


def smallest_pools(
    profile: EngineProfile,
    options: PlannerOptions,
    forecast: LoadForecast,
    disaggregated: bool,
    corrections: tuple[float, float],
    cap: float,
) -> tuple[PoolSizes, float, float]:
    """The pools ``options.sizing`` asks for under ``forecast``, with the TTFT and ITL the model
    predicts for them. ``corrections`` (observed ÷ modelled TTFT and ITL) scale the targets as the
    model's times reach them; ``cap`` bounds a worker's planned prefill utilisation. Within
    [min_workers, max_workers] per pool (the prefill pool within its own ceiling)."""
    ttft_correction, itl_correction = corrections
    o = options
    if o.sizing == "dynamo":
        prefill_share, decode_share = capacity.dynamo_shares(profile, forecast, o.itl_target_ms, *corrections)
        if not disaggregated:
            size = min(max(math.ceil(prefill_share + decode_share), o.min_workers), o.max_workers)
            estimate = capacity.aggregated(profile, forecast, size)
            return PoolSizes(aggregated=size), estimate.ttft_ms, estimate.itl_ms
        prefill = min(max(math.ceil(prefill_share), o.min_workers, 1), o.prefill_ceiling)
        decode = min(max(math.ceil(decode_share), o.min_workers, 1), o.max_workers)
        p = capacity.prefill_pool(profile, forecast, prefill)
        d = capacity.decode_pool(profile, forecast, decode)
        return PoolSizes(prefill=prefill, decode=decode), p.ttft_ms, d.itl_ms
    ttft_limit = o.ttft_target_ms * o.ttft_headroom / ttft_correction
    itl_limit = o.itl_target_ms * o.itl_headroom / itl_correction
    # the TTFT target as the model's times reach it (they are corrected by observed ÷ modelled)
    target = o.ttft_target_ms / ttft_correction
    goal = o.attainment_goal
    if not disaggregated:
        size, estimate = capacity.smallest_pool(
            lambda n: capacity.aggregated(profile, forecast, n, target),
            capacity.Limits(ttft_limit, itl_limit, cap, goal),
            o.min_workers,
            o.max_workers,
        )
        return PoolSizes(aggregated=size), estimate.ttft_ms, estimate.itl_ms

    prefill_limits = capacity.Limits(ttft_ms=ttft_limit, utilisation=cap, ttft_attainment=goal)
    prefill, p = capacity.smallest_pool(
        lambda n: capacity.prefill_pool(profile, forecast, n, target),
        prefill_limits,
        max(o.min_workers, 1),
        o.prefill_ceiling,
    )
    decode, d = capacity.smallest_pool(
        lambda n: capacity.decode_pool(profile, forecast, n),
        capacity.Limits(itl_ms=itl_limit),
        o.min_workers,
        o.max_workers,
    )
    if not prefill_limits.met_by(p):
        # the prefill pool at its ceiling cannot take the load: the router prefills the rest on
        # the decode workers (a split that does not pay stays local), so the decode pool is
        # sized as an aggregated pool for that overflow as well
        served = capacity.rate_served(lambda rate: prefill_limits.met_by(capacity.prefill_pool(
            profile, dataclasses.replace(forecast, request_rate=rate), prefill, target
        )), forecast.request_rate)  # fmt: skip
        overflow = dataclasses.replace(forecast, request_rate=forecast.request_rate - served)
        local, d = capacity.smallest_pool(
            lambda n: capacity.aggregated(profile, overflow, n, target),
            capacity.Limits(ttft_limit, itl_limit, ttft_attainment=goal),
            o.min_workers,
            o.max_workers,
        )
        decode = max(decode, local)
    return PoolSizes(prefill=prefill, decode=decode), p.ttft_ms, d.itl_ms
