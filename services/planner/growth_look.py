"""Looks between decisions (``--growth-look-secs``): the part of an interval seen so far, judged for
growth alone, so that a fleet far behind its load starts workers seconds after it falls behind
instead of at the interval's end (decision 65).

A worker asked for at the end of an interval serves a start-up later; a load that outgrows the fleet
early in an interval is served short for most of two. A look sees the requests finished since the
interval began. It grows a pool only where their attainment is below the goal by more than chance
explains (:func:`clearly_below`): a few seconds of requests are noisy, and a growth is held by the
shrink guards for minutes. A look feeds no predictor and teaches the cap nothing; the decision at the
interval's end sees the whole interval, as before, and judges it by the same test while the SLA's
window has misses to spare (decision 66).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvmesh.planner.decision import PoolSizes
from kvmesh.planner.load import IntervalObservation, LoadForecast
from kvmesh.planner.options import PlannerOptions

# A look grows a pool only where its misses are this many standard deviations above what the goal
# allows (binomial, over the requests finished so far): at 33 requests and a 0.95 goal, 6 misses or
# more. A pool meeting the goal exactly passes a look at three sigmas about once in 700 (a shrink
# guard then holds the worker for minutes); a fleet started at 2 workers into a crest missed 30 of 33
# in its first 5 s.
LOOK_SIGMAS = 3.0
LOOK_MIN_FINISHED = 10  # fewer say nothing (the step's own MIN_FINISHED_FOR_FEEDBACK)


def clearly_below(goal: float, finished: int) -> Callable[[float | None], bool]:
    """Whether a share of ``finished`` requests meeting the targets is below ``goal`` by more than
    chance explains (``LOOK_SIGMAS`` binomial deviations of the misses); False for too few requests."""

    def below(attained: float | None) -> bool:
        if attained is None or finished < LOOK_MIN_FINISHED:
            return False
        allowed = finished * (1 - goal)
        return finished * (1 - attained) >= allowed + LOOK_SIGMAS * math.sqrt(finished * goal * (1 - goal))

    return below


def below(goal: float) -> Callable[[float | None], bool]:
    """Whether a measured share is below ``goal`` (the decision's own test of an interval)."""
    return lambda attained: attained is not None and attained < goal


def pools_at_fault(
    observation: IntervalObservation, disaggregated: bool, missed: Callable[[float | None], bool]
) -> list[str]:
    """The pools a growth the SLA demands (a look, or a missed interval) grows: the aggregated pool;
    disaggregated, the prefill pool where its TTFT attainment is ``missed`` and the decode pool where
    its ITL attainment is."""
    if not disaggregated:
        return ["aggregated"]
    shares = (("prefill", observation.ttft_attainment), ("decode", observation.itl_attainment))
    return [pool for pool, share in shares if missed(share)]


def seen_load(partial: IntervalObservation, backlog: float, drain_s: float) -> LoadForecast:
    """The load a look sizes for: the rate seen so far plus the backlog (``backlog`` queued before the
    interval, and the arrivals it has not finished) drained within ``drain_s``, with the shapes of the
    requests finished so far (a look acts only on finished ones: :func:`clearly_below`)."""
    behind = backlog + max(0, partial.requests - partial.finished)
    return LoadForecast(
        partial.request_rate + behind / drain_s,
        partial.mean_input_tokens,
        partial.mean_output_tokens,
        partial.prefix_hit_fraction,
        partial.input_tokens_cv2,
        partial.uncached_quantiles,
    )


def one_more(pools: list[str], wanted: PoolSizes, current: PoolSizes, options: PlannerOptions) -> dict[str, int]:
    """The sizes ``pools`` grow to when the SLA demands growth (a look, or a missed interval): what the
    model asks for (``wanted``) and at least one more than ``current``, within each pool's ceiling."""
    sizes = {}
    for pool in pools:
        ceiling = options.prefill_ceiling if pool == "prefill" else options.max_workers
        sizes[pool] = min(max(getattr(wanted, pool), getattr(current, pool) + 1), ceiling)
    return sizes
