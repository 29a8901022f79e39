"""Per-worker load: what a router's tracker reports, its wire format, and how the planner merges
several routers' reports over an interval."""

from __future__ import annotations

import asyncio
import dataclasses

import msgpack
import pytest

from kvmesh.common.wire.worker_load import RouterLoadReport, WorkerLoad, WorkerLoadError, merge_router_reports
from kvmesh.planner.decision import PoolSizes
from kvmesh.planner.load import observe_interval
from kvmesh.planner.planner import Planner
from kvmesh.planner.state import PlannerState
from kvmesh.router.load_tracker import LoadTracker
from tests.planner.test_planner import PROFILE, options

BLOCK = 16


def test_the_tracker_reports_requests_prefill_and_kv_per_worker_with_shared_prefixes_once():
    tracker = LoadTracker()
    # two requests on worker 7 sharing their first two blocks; one on worker 9
    tracker.add("a", (7, 0), BLOCK, [1, 2, 3], 48, 0, 0, now=0.0)
    tracker.add("b", (7, 0), BLOCK, [1, 2, 4], 48, 2, 0, now=0.0)
    tracker.add("c", (9, 0), BLOCK, [5], 20, 0, 0, now=0.0)
    loads = {load.worker_id: load for load in tracker.worker_loads()}
    assert loads[7].requests == 2 and loads[9].requests == 1
    assert loads[7].prefill_tokens == 48 + 16  # b had two of its blocks cached
    assert loads[7].kv_tokens == 4 * BLOCK  # blocks 1, 2, 3, 4
    assert loads[9].kv_tokens == 2 * BLOCK  # one full block and a partial one of its own
    tracker.first_token("a")
    tracker.free("b")
    tracker.free("c")
    loads = {load.worker_id: load for load in tracker.worker_loads()}
    assert (loads[7].requests, loads[7].prefill_tokens, loads[7].kv_tokens) == (1, 0, 3 * BLOCK)
    assert (loads[9].requests, loads[9].prefill_tokens, loads[9].kv_tokens) == (0, 0, 0)


def test_a_report_round_trips_and_anything_else_is_refused():
    report = RouterLoadReport("router-1", 12.5, (WorkerLoad(7, 0, 2, 64, 1024), WorkerLoad(9, 1, 0, 0, 0)))
    assert RouterLoadReport.decode(report.encode()) == report
    for data in (b"\xc1 not msgpack", msgpack.packb([99, "r", 0.0, []]), msgpack.packb([1, "r", 0.0, [[1, 2]]])):
        with pytest.raises(WorkerLoadError):
            RouterLoadReport.decode(data)


def test_the_planner_averages_each_router_and_keeps_the_fuller_view_of_each_worker():
    def report(router: str, *loads: tuple[int, float, float]) -> RouterLoadReport:
        return RouterLoadReport(router, 0.0, tuple(WorkerLoad(w, 0, r, 0, kv) for w, r, kv in loads))

    merged = merge_router_reports(
        [
            report("r1", (7, 4, 400), (9, 0, 0)),
            report("r1", (7, 2, 200)),  # worker 9 absent: no load in that report
            report("r2", (7, 1, 100), (9, 2, 300)),  # r2 missed some of r1's requests on 7
        ]
    )
    assert [(w.worker_id, w.requests, w.kv_tokens) for w in merged] == [(7, 3, 300), (9, 2, 300)]


def test_the_observation_keeps_the_worker_loads_through_the_state_file(tmp_path):
    loads = (WorkerLoad(7, 0, 3.5, 100.0, 2048.0),)
    observation = observe_interval(10, [], 0.0, 10.0, 2000.0, 50.0, workers=1, worker_loads=loads)
    decision = Planner(options(), PROFILE).step(observation, PoolSizes(aggregated=1))

    async def round_trip():
        async with PlannerState(tmp_path / "state.sqlite") as state:
            await state.record(observation, decision)
            return await state.recent(1)

    (stored,) = asyncio.run(round_trip())
    assert stored.observation == observation
    assert dataclasses.asdict(stored.observation)["worker_loads"][0]["kv_tokens"] == 2048.0


def test_an_interval_measures_each_target_apart_and_the_uncached_lengths_distribution():
    from kvmesh.common.wire.frontend_load import RequestSample

    samples = [RequestSample(1000 * (i + 1), 10, 500, ttft_ms=100.0 * i, itl_ms=10.0) for i in range(20)]
    samples[0] = RequestSample(1000, 10, 0, ttft_ms=50.0, itl_ms=90.0)  # one slow token stream
    observation = observe_interval(20, samples, 0.0, 10.0, ttft_target_ms=1000.0, itl_target_ms=50.0)
    assert observation.ttft_attainment == 11 / 20  # TTFTs 0, 100, ..., 1000 ms
    assert observation.itl_attainment == 19 / 20
    assert observation.sla_attainment == 10 / 20
    assert len(observation.uncached_quantiles) == 16
    assert observation.uncached_quantiles[0] == 1000 and observation.uncached_quantiles[-1] == 19500
    assert list(observation.uncached_quantiles) == sorted(observation.uncached_quantiles)
