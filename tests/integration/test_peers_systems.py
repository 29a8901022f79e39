"""``bench.peers`` reads each system's CPU from the processes that system's start made.

``--interleave`` runs every system at once, and two bare layouts have processes of the same names:
counting by name alone would give each layout the other's CPU too. Two real bare layouts run side
by side here, and each must see its own processes only.
"""

from __future__ import annotations

import pytest

from bench.peers import LAYOUT_SERVING, LOADGEN, System, run_scenario

LAYOUT_WORKERS = ("bare_layout --role worker",)


def test_two_bare_layouts_side_by_side_each_count_their_own_processes() -> None:
    first = System("layout", "tiny", LAYOUT_SERVING, LAYOUT_WORKERS)
    second = System("layout-forward", "tiny", LAYOUT_SERVING, LAYOUT_WORKERS)
    try:
        first.start(100)
        second.start(100)
        serving = [set(system.processes(system.serving)) for system in (first, second)]
        workers = [set(system.processes(system.engines)) for system in (first, second)]
        # frontend, router and indexer; two workers
        assert [len(pids) for pids in serving] == [3, 3]
        assert [len(pids) for pids in workers] == [2, 2]
        assert not serving[0] & serving[1] and not workers[0] & workers[1]
        assert first.processes(()) == []
    finally:
        first.stop()
        second.stop()
    assert first.processes(first.serving) == [] and second.processes(second.serving) == []


@pytest.mark.skipif(not LOADGEN.exists(), reason="the load generator is ../shared/peers/loadgen.py")
def test_a_scenario_reports_the_cpu_of_the_system_it_loaded() -> None:
    # the mock engine, and enough requests, for the workers' CPU to span several clock ticks (10 ms):
    # workers that answer at once spend less than one on a short load, and /proc then reads 0
    layout = System("layout-engine", "tiny", LAYOUT_SERVING, LAYOUT_WORKERS)
    try:
        layout.start(100)
        report = run_scenario(layout, max_tokens=8, concurrency=2, requests=200, stream=False)
    finally:
        layout.stop()
    assert report["ok"] == 200 and report["errors"] == 0
    assert report["cpu_ms"] is not None and report["cpu_ms"] > 0
    assert report["engine_cpu_ms"] is not None and report["engine_cpu_ms"] > 0
