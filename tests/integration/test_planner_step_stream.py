"""The planners' shared memory (``--state-store nats``) on a real NATS: steps come back in the order
recorded, each namespace sees only its own, and a planner resumed from the stream on another replica
decides exactly as the one that recorded them would have."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.planner.decision import PoolSizes
from kvmesh.planner.options import PlannerOptions
from kvmesh.planner.planner import Planner
from kvmesh.planner.state import resume
from kvmesh.planner.step_stream import JetStreamSteps
from kvmesh.profiler.mock import profile_mock_engine
from tests.planner.intervals import interval

pytestmark = pytest.mark.integration
PROFILE = profile_mock_engine()
OPTIONS = PlannerOptions(load_predictor="moving-average", min_workers=1, max_workers=12, scale_down_intervals=2)


async def test_a_standby_resumed_from_the_stream_decides_as_the_planner_it_replaces(nc: NatsClient):
    loads = [1.0, 3.0, 6.0, 9.0, 4.0, 2.0, 7.0, 5.0]
    acting = Planner(OPTIONS, PROFILE)
    pools = PoolSizes(aggregated=1)
    async with JetStreamSteps(nc, "steps-a") as state, JetStreamSteps(nc, "steps-b") as other:
        assert await state.recent(10) == [] and await state.last() is None
        for i, rate in enumerate(loads[:-1]):
            observation = interval(i * 10, rate, 0.9 if i % 2 else 1.0, ttft=500.0)
            decision = acting.step(observation, pools)
            await state.record(observation, decision)
            await other.record(dataclasses.replace(observation, requests=0), decision)  # another namespace's
            pools = decision.target
        assert await state.count() == len(loads) - 1
        recent = await state.recent(100)
        assert [s.observation.start_s for s in recent] == [i * 10 for i in range(len(loads) - 1)]
        assert all(s.observation.requests > 0 for s in recent)  # none of the other namespace's
        assert [s.observation.start_s for s in await state.recent(3)] == [40, 50, 60]
        last = await state.last()
        assert last is not None and last.decision.target == pools
        standby = Planner(OPTIONS, PROFILE)
        resumed = resume(standby, recent)
    assert resumed is not None and resumed.target == pools
    final = interval(70, loads[-1], 1.0, ttft=500.0)
    expected = acting.step(final, pools)
    assert standby.step(final, pools) == expected
    fresh = Planner(OPTIONS, PROFILE)  # a standby without the history decides otherwise
    assert fresh.step(final, pools) != expected


async def test_planner_history_reads_the_stream(nats_url: str, nc: NatsClient):
    planner = Planner(OPTIONS, PROFILE)
    async with JetStreamSteps(nc, "steps-history") as state:
        for i in range(3):
            observation = interval(i * 10, 2.0 + i, 1.0, ttft=500.0)
            await state.record(observation, planner.step(observation, PoolSizes(aggregated=1)))
    command = [sys.executable, "-m", "kvmesh", "planner", "history", "--state-store", "nats", "--nats-url", nats_url]
    shown = subprocess.run(
        [*command, "--namespace", "steps-history", "--json", "--limit", "2"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert [row["observation"]["start_s"] for row in json.loads(shown.stdout)] == [10, 20]
    empty = subprocess.run([*command, "--namespace", "nobody-here"], capture_output=True, text=True, timeout=60)
    assert empty.returncode == 0 and "no decisions recorded yet" in empty.stdout
