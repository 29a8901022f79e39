import itertools
import math

import pytest

from kvmesh.planner import capacity
from kvmesh.planner.load import LoadForecast
from kvmesh.profiler.mock import profile_mock_engine

PROFILE = profile_mock_engine()
LOAD = LoadForecast(request_rate=4.0, mean_input_tokens=8000, mean_output_tokens=150, prefix_hit_fraction=0.3)


def test_more_workers_serve_the_same_load_faster():
    estimates = [capacity.aggregated(PROFILE, LOAD, n) for n in (2, 3, 4, 8)]
    assert all(a.ttft_ms > b.ttft_ms and a.itl_ms > b.itl_ms for a, b in itertools.pairwise(estimates))


def test_more_load_is_slower_and_overload_is_unbounded():
    light = capacity.aggregated(PROFILE, LOAD, 4)
    heavy = capacity.aggregated(PROFILE, LoadForecast(12.0, 8000, 150, 0.3), 4)
    assert heavy.ttft_ms > light.ttft_ms and heavy.utilisation > light.utilisation
    overloaded = capacity.aggregated(PROFILE, LoadForecast(100.0, 8000, 150, 0.3), 1)
    assert not overloaded.stable and math.isinf(overloaded.ttft_ms)


def test_heavier_tailed_prompts_queue_longer():
    even = capacity.aggregated(PROFILE, LOAD, 2)
    tailed = capacity.aggregated(PROFILE, LoadForecast(4.0, 8000, 150, 0.3, input_tokens_cv2=2.0), 2)
    assert tailed.ttft_ms > even.ttft_ms


def test_the_smallest_pool_meeting_the_limits_is_chosen():
    size, estimate = capacity.smallest_pool(
        lambda n: capacity.aggregated(PROFILE, LOAD, n), capacity.Limits(ttft_ms=400), 1, 16
    )
    assert estimate.ttft_ms <= 400
    assert capacity.aggregated(PROFILE, LOAD, size - 1).ttft_ms > 400


def test_limits_no_pool_can_meet_buy_no_more_than_diminishing_returns():
    size, _ = capacity.smallest_pool(lambda n: capacity.aggregated(PROFILE, LOAD, n), capacity.Limits(ttft_ms=1), 1, 16)
    assert size < 16
    best = capacity.aggregated(PROFILE, LOAD, 16).ttft_ms
    assert capacity.aggregated(PROFILE, LOAD, size).ttft_ms <= best * capacity.DIMINISHING_RETURNS


def test_a_limit_no_pool_meets_gives_way_alone():
    # long prompts: the mean TTFT of any pool is over a limit its prefill alone exceeds, while the
    # share within the target is met by a few workers; the pool is sized for that share, not for the
    # largest pool's
    long = LoadForecast(0.6, 50_000, 120, 0.0, input_tokens_cv2=0.3)
    target = 2.5 * PROFILE.ttft_ms(50_000)

    def estimate(n: int) -> capacity.Estimate:
        return capacity.aggregated(PROFILE, long, n, target)

    unreachable = 0.9 * estimate(16).ttft_ms
    goal = 0.95
    size, chosen = capacity.smallest_pool(estimate, capacity.Limits(ttft_ms=unreachable, ttft_attainment=goal), 1, 16)
    assert chosen.ttft_attainment >= goal
    assert chosen.ttft_ms <= estimate(16).ttft_ms * capacity.DIMINISHING_RETURNS
    near_best = capacity.Limits(ttft_ms=estimate(16).ttft_ms * capacity.DIMINISHING_RETURNS)
    # the kept limit and the loosened one decide together: no larger than either alone asks
    alone, _ = capacity.smallest_pool(estimate, near_best, 1, 16)
    by_goal, _ = capacity.smallest_pool(estimate, capacity.Limits(ttft_attainment=goal), 1, 16)
    assert size == max(alone, by_goal)
    assert size < 16


def test_disaggregated_pools_each_answer_for_their_own_target():
    prefill = capacity.prefill_pool(PROFILE, LOAD, 2)
    decode = capacity.decode_pool(PROFILE, LOAD, 2)
    assert prefill.ttft_ms > 0 and prefill.itl_ms == 0
    assert decode.itl_ms > 0 and decode.ttft_ms == 0
    assert capacity.prefill_pool(PROFILE, LOAD, 4).ttft_ms < prefill.ttft_ms
    assert capacity.decode_pool(PROFILE, LOAD, 4).itl_ms <= decode.itl_ms


def test_dynamo_style_sizing_grows_with_the_load_and_follows_its_corrections():
    def workers(load: LoadForecast, prefill_correction: float = 1.0) -> float:
        return sum(capacity.dynamo_shares(PROFILE, load, 50, prefill_correction, decode_correction=1))

    heavy_load = LoadForecast(12.0, 8000, 150, 0.3)
    light, heavy = workers(LOAD), workers(heavy_load)
    assert 0 < light < heavy
    # prefix hits (TTFT below profile: correction < 1) lower the prefill load; slow decode raises the rest
    assert workers(heavy_load, prefill_correction=0.3) < heavy
    # a correction above 1 never raises the prefill load (Dynamo caps it at 1)
    assert workers(LOAD, prefill_correction=3.0) == light
    # the decode share alone grows with the output tokens asked for
    prefill, decode = capacity.dynamo_shares(PROFILE, heavy_load, 50, 1, 1)
    longer = capacity.dynamo_shares(PROFILE, LoadForecast(12.0, 8000, 300, 0.3), 50, 1, 1)
    assert longer[0] == prefill and longer[1] > decode


def test_the_share_within_the_ttft_target_comes_from_the_prompt_lengths_distribution():
    # the same mean uncached length (5600 tokens), once even and once with a long tail
    even = LoadForecast(4.0, 8000, 150, 0.3, uncached_quantiles=(5600.0,) * 16)
    tail = LoadForecast(4.0, 8000, 150, 0.3, uncached_quantiles=(2000.0,) * 14 + (30800.0,) * 2)
    target = 2 * PROFILE.ttft_ms(5600)
    for n in (2, 4):
        assert capacity.aggregated(PROFILE, tail, n, target).ttft_attainment < (
            capacity.aggregated(PROFILE, even, n, target).ttft_attainment
        )
    shares = [capacity.aggregated(PROFILE, tail, n, target).ttft_attainment for n in (2, 3, 4, 8)]
    assert all(a <= b for a, b in itertools.pairwise(shares)) and shares[0] < shares[-1]
    # a prompt whose prefill alone outlasts the target misses on any pool: the share is of the others,
    # which enough workers serve in time, and none of a load that is all such prompts
    beyond = PROFILE.ttft_ms(30800) * 0.9
    assert capacity.prefill_pool(PROFILE, tail, 64, beyond).ttft_attainment > 0.99
    assert capacity.prefill_pool(PROFILE, tail, 1, beyond).ttft_attainment < 0.99
    longest = LoadForecast(4.0, 30800, 150, 0.0, uncached_quantiles=(30800.0,) * 16)
    assert capacity.prefill_pool(PROFILE, longest, 64, beyond).ttft_attainment == 0.0
    assert capacity.aggregated(PROFILE, even, 4).ttft_attainment == 1.0  # no target asked about


def test_the_waiting_share_follows_the_queue():
    assert capacity.ttft_attainment([100.0] * 4, wait_ms=0.0, waiting=0.0, target_ms=150.0) == 1.0
    # of the requests that can meet the target: the 200 ms one cannot, whatever the queue
    assert capacity.ttft_attainment([100.0, 200.0], wait_ms=0.0, waiting=0.0, target_ms=150.0) == 1.0
    assert capacity.ttft_attainment([200.0, 300.0], wait_ms=0.0, waiting=0.0, target_ms=150.0) == 0.0
    busy = capacity.ttft_attainment([100.0], wait_ms=200.0, waiting=0.8, target_ms=150.0)
    calm = capacity.ttft_attainment([100.0], wait_ms=20.0, waiting=0.2, target_ms=150.0)
    assert 0 < busy < calm < 1


def test_workers_that_share_the_arrivals_are_waited_on_less_than_as_many_lone_queues():
    assert capacity.erlang_c(1, 0.4) == pytest.approx(0.4)
    assert capacity.erlang_c(2, 0.5) == pytest.approx(1 / 3)  # M/M/2 at half load, by hand
    assert capacity.erlang_c(3, 0.0) == 0.0
    shares = [capacity.erlang_c(n, 0.5) for n in (1, 2, 4, 8)]
    assert all(a > b for a, b in itertools.pairwise(shares))
    # one worker: Pollaczek-Khinchine, λ E[P²] / 2 (1 − ρ) with λ = ρ / E[P]
    wait, waiting = capacity.queue_wait(1, 0.3, 1000.0, 2e6)
    assert wait == pytest.approx(0.3 / 1000.0 * 2e6 / (2 * 0.7)) and waiting == pytest.approx(0.3)


def test_a_trough_of_long_prompts_is_served_in_time_by_few_workers():
    # 0.6 long prompts a second: one worker is a third busy; with two sharing the arrivals, a prompt
    # that fits the target finds one free far more often than it would a lone worker
    trough = LoadForecast(0.6, 30000, 150, 0.0, uncached_quantiles=(20000.0, 30000.0, 40000.0))
    target = PROFILE.ttft_ms(40000) * 1.5
    one, two = (capacity.aggregated(PROFILE, trough, n, target) for n in (1, 2))
    assert one.utilisation == pytest.approx(2 * two.utilisation)
    # (as two lone queues each half as busy, the misses would only halve: 0.048 against 0.129 here)
    assert 1 - two.ttft_attainment < (1 - one.ttft_attainment) / 10
    assert two.ttft_ms < one.ttft_ms
