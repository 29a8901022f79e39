"""The performance model's corrections: how far an interval's observed TTFT and ITL were from what the
model says for that interval's load on the pools that served it, smoothed from interval to interval.

Sizing multiplies the model's latencies by them, so a model that errs one way (a slower engine than
profiled, queue waits it does not see) is sized as it behaves. One interval moves a correction half
way toward what it observed, within bounds: a single odd interval cannot swing the fleet.
"""

from __future__ import annotations

import math

from kvmesh.common.core.engine_profile import EngineProfile
from kvmesh.planner import capacity
from kvmesh.planner.decision import PoolSizes
from kvmesh.planner.load import IntervalObservation, LoadForecast

# how far one interval's observations may move a correction, and its bounds
CORRECTION_SMOOTHING = 0.5
CORRECTION_BOUNDS = (0.5, 2.0)


def modelled(profile: EngineProfile, seen: LoadForecast, pools: PoolSizes, disaggregated: bool) -> tuple[float, float]:
    """The model's mean TTFT and ITL (ms) for the load ``seen`` on ``pools``."""
    if disaggregated:
        return (
            capacity.prefill_pool(profile, seen, pools.prefill).ttft_ms,
            capacity.decode_pool(profile, seen, pools.decode).itl_ms,
        )
    estimate = capacity.aggregated(profile, seen, pools.aggregated)
    return estimate.ttft_ms, estimate.itl_ms


def corrected(
    corrections: tuple[float, float],
    observation: IntervalObservation,
    pools: PoolSizes,
    profile: EngineProfile,
    *,
    disaggregated: bool,
    dynamo: bool,
) -> tuple[float, float]:
    """The (TTFT, ITL) ``corrections`` moved toward observed ÷ modelled for ``observation`` served on
    ``pools``; unchanged where nothing was observed. With Dynamo's sizing (``dynamo``) the model is
    Dynamo's: the profiled TTFT of the whole prompt and the profiled ITL at the load seen."""
    ttft_correction, itl_correction = corrections
    if not observation.requests or not observation.ttft_mean_ms:
        return corrections
    seen = LoadForecast(
        observation.request_rate,
        observation.mean_input_tokens,
        observation.mean_output_tokens,
        observation.prefix_hit_fraction,
        observation.input_tokens_cv2,
    )
    ttft, itl = modelled(profile, seen, pools, disaggregated)
    if dynamo:
        per_worker = seen.request_rate / max(pools.total, 1)
        concurrency = per_worker * seen.mean_output_tokens * (observation.itl_mean_ms or 1.0) / 1000
        context = seen.mean_input_tokens + seen.mean_output_tokens / 2
        ttft = profile.ttft_ms(seen.mean_input_tokens)
        itl = profile.itl_ms(max(concurrency, 1.0), context)
    low, high = CORRECTION_BOUNDS
    if math.isfinite(ttft) and ttft > 0:
        ratio = min(max(observation.ttft_mean_ms / ttft, low), high)
        ttft_correction += CORRECTION_SMOOTHING * (ratio - ttft_correction)
    if math.isfinite(itl) and itl > 0 and observation.itl_mean_ms:
        ratio = min(max(observation.itl_mean_ms / itl, low), high)
        itl_correction += CORRECTION_SMOOTHING * (ratio - itl_correction)
    return ttft_correction, itl_correction
