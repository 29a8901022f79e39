"""Looks between decisions (decision 65): a pool clearly behind the goal in the interval so far grows
then, sized by the model at the load seen; chance misses, a handful of requests, a worker not yet
joined, an SLA window with misses to spare, Dynamo's sizing and a pool at its ceiling grow nothing."""

from __future__ import annotations

import dataclasses

from kvmesh.planner.decision import PoolSizes
from kvmesh.planner.growth_look import clearly_below
from kvmesh.planner.load import IntervalObservation
from kvmesh.planner.options import PlannerOptions
from kvmesh.planner.planner import Planner
from kvmesh.profiler.mock import profile_mock_engine
from tests.planner.intervals import interval

PROFILE = profile_mock_engine()


def options(**overrides) -> PlannerOptions:
    values = {
        "load_predictor": "constant",
        "max_workers": 12,
        "adjustment_interval": 15.0,
        "worker_startup_secs": 15.0,
        "growth_look_secs": 5.0,
    }
    return PlannerOptions(**{**values, **overrides})


def so_far(
    start: float, seconds: float, rate: float, finished: int, attainment: float, **fields
) -> IntervalObservation:
    """The first ``seconds`` of an interval at ``rate`` requests a second, ``finished`` of them done."""
    observation = dataclasses.replace(
        interval(start, rate, attainment=attainment),
        duration_s=seconds,
        requests=round(rate * seconds),
        finished=finished,
    )
    return dataclasses.replace(observation, **fields)


def looked(planner: Planner, partial: IntervalObservation, current: PoolSizes) -> PoolSizes | None:
    """A look as the planner service and the replay make one: the pools behind, then their growth."""
    behind = planner.look(partial)
    return planner.grow(partial, behind, current) if behind else None


def test_behind_the_goal_means_beyond_what_chance_explains():
    # 33 requests at a 0.95 goal: 1.65 misses expected, 3 standard deviations is 3.8 more
    assert clearly_below(0.95, 33)(1 - 6 / 33)
    assert not clearly_below(0.95, 33)(1 - 5 / 33)
    assert not clearly_below(0.95, 9)(0.0)  # too few requests say nothing
    assert not clearly_below(0.95, 33)(None)


def test_a_look_grows_a_pool_far_behind_at_once_and_not_again_before_its_worker_joins():
    planner = Planner(options(), PROFILE)
    pools = PoolSizes(aggregated=2)
    # started into a crest: 5 s into the first interval, 30 of 33 finished requests missed
    grown = looked(planner, so_far(15, 5, 30.0, 33, 3 / 33), pools)
    assert grown is not None and grown.aggregated >= pools.aggregated + 1
    assert grown.aggregated >= pools.aggregated + 2  # sized by the model at the rate seen, not one at a time
    # the workers it asked for take 15 s: five seconds later the same shortfall grows nothing
    assert looked(planner, so_far(15, 10, 30.0, 60, 0.1), grown) is None
    # nor does the decision at the interval's end grow by one more for the misses it saw
    decision = planner.step(dataclasses.replace(interval(15, 30.0, attainment=0.1), finished=100), grown)
    assert decision.target.aggregated == max(grown.aggregated, decision.wanted.aggregated)
    # once they have had their start-up, a load still outgrowing them grows the pool again
    again = looked(planner, so_far(30, 5, 60.0, 33, 0.1), decision.target)
    assert again is not None and again.aggregated > decision.target.aggregated


def test_a_look_grows_nothing_on_chance_misses_few_requests_or_at_the_ceiling():
    planner = Planner(options(), PROFILE)
    pools = PoolSizes(aggregated=3)
    assert looked(planner, so_far(0, 5, 7.0, 33, 1 - 4 / 33), pools) is None  # within chance
    assert looked(planner, so_far(0, 5, 7.0, 8, 0.0), pools) is None  # too few finished
    assert looked(planner, so_far(0, 5, 7.0, 33, 0.1), PoolSizes(aggregated=12)) is None  # at the ceiling
    dynamo = Planner(options(sizing="dynamo"), PROFILE)
    assert looked(dynamo, so_far(0, 5, 7.0, 33, 0.1), pools) is None  # Dynamo's sizing has no looks


def test_a_disaggregated_look_grows_the_pool_whose_target_is_missed():
    planner = Planner(options(), PROFILE, disaggregated=True)
    pools = PoolSizes(prefill=2, decode=2)
    slow_first_tokens = so_far(0, 5, 7.0, 33, 0.2, ttft_attainment=0.2, itl_attainment=1.0)
    grown = looked(planner, slow_first_tokens, pools)
    assert grown is not None and grown.prefill > 2 and grown.decode == 2


def test_a_look_leaves_growth_to_the_decision_while_the_sla_window_has_misses_to_spare():
    planner = Planner(options(), PROFILE)
    pools = planner.step(dataclasses.replace(interval(0, 4.0), finished=400), PoolSizes(aggregated=3)).target
    assert planner.window_attainment() == 1.0
    assert looked(planner, so_far(15, 5, 30.0, 33, 3 / 33), pools) is None
    # once the window has spent its spare misses (and the worker that miss added has joined), the
    # same look grows the pool
    pools = planner.step(dataclasses.replace(interval(15, 4.0, attainment=0.8), finished=400), pools).target
    assert planner.window_attainment() == 0.9
    assert looked(planner, so_far(35, 5, 30.0, 33, 3 / 33), pools) is not None


def test_a_look_measures_a_start_up_to_itself_not_to_the_interval_end():
    planner = Planner(options(worker_startup_secs=30.0), PROFILE)  # a guess the fleet beats
    grown = looked(planner, so_far(15, 5, 30.0, 33, 3 / 33), PoolSizes(aggregated=2))  # asked at 20 s
    assert grown is not None
    # the workers serve by the look at 35 s (5 s into the interval from 30 s): measured 15 s
    planner.look(so_far(30, 5, 4.0, 20, 1.0, workers=grown.aggregated))
    assert planner.worker_startup_s == 15.0
