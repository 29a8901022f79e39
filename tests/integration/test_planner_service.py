"""`kvmesh planner run` over real NATS: it merges the frontends' load reports and the routers'
per-worker loads into its decisions, records every step in SQLite, and after kill -9 resumes with
its window; between decisions it looks, and grows a fleet far behind at once."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess

import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.wire import names
from kvmesh.common.wire.frontend_load import LoadReport, RequestSample
from kvmesh.common.wire.worker_load import RouterLoadReport, WorkerLoad
from kvmesh.planner.state import PlannerState
from kvmesh.profiler.mock import profile_mock_engine
from tests.support import service_process, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "planning"


def planner_process(nats_url: str, profile, state) -> subprocess.Popen[bytes]:
    return service_process(
        "planner",
        nats_url,
        NAMESPACE,
        "--engine-profile", str(profile),
        "--state-db", str(state),
        "--connector", "no-operation",
        "--adjustment-interval", "1",
        "--load-predictor", "moving-average",
        "--predictor-window", "3",
        "--metrics-port", "-1",
        # a planner restarted after kill -9 waits out its predecessor's lease before it acts: 15 s by
        # default, which this test would spend idle (leases have their own tests)
        "--planner-lease-secs", "2",
    )  # fmt: skip


async def steps(state_path) -> list:
    async with PlannerState(state_path) as state:
        return await state.recent(1000)


async def publish(nc: NatsClient, arrivals: int) -> None:
    sample = RequestSample(2000, 32, 500, 150.0, 12.0)
    report = LoadReport("frontend-test", 0.0, 0.25, arrivals, (sample,) * min(arrivals, 5))
    await nc.publish(names.load_report_subject(NAMESPACE), report.encode())
    router = RouterLoadReport("router-test", 0.0, (WorkerLoad(7, 0, float(arrivals), 100.0, 4096.0),))
    await nc.publish(names.router_load_subject(NAMESPACE), router.encode())
    await nc.flush()


async def test_the_planner_decides_from_load_reports_and_resumes_after_kill_9(nats_url, nc, tmp_path):
    profile, state = tmp_path / "profile.json", tmp_path / "planner.sqlite"
    profile_mock_engine().save(profile)
    planner = planner_process(nats_url, profile, state)
    try:

        async def busy_until(condition, what: str) -> None:
            async def published_and_checked() -> bool:
                await publish(nc, arrivals=5)  # 20 requests/s at four reports a second
                await asyncio.sleep(0.25)
                return await condition()

            await wait_until_async(published_and_checked, timeout=30, what=what)

        async def loaded_steps() -> bool:
            recorded = await steps(state)
            return sum(1 for s in recorded if s.observation.request_rate > 0) >= 4

        await busy_until(loaded_steps, "four steps that saw the load")
        before = await steps(state)
        assert max(s.observation.request_rate for s in before) >= 10
        # the routers' per-worker load is part of what the planner observed and stored
        assert any(
            load.worker_id == 7 and load.requests == 5 and load.kv_tokens == 4096
            for s in before
            for load in s.observation.worker_loads
        )
        assert max(s.decision.forecast.request_rate for s in before) >= 10
        planner.send_signal(signal.SIGKILL)
        planner.wait(timeout=10)
        recorded = len(await steps(state))  # the file is whole after kill -9

        planner = planner_process(nats_url, profile, state)

        async def two_idle_steps_after_restart() -> bool:
            return len(await steps(state)) >= recorded + 1

        # no load now: a planner that lost its window would forecast 0; a resumed one averages
        # its last intervals with the idle one
        await wait_until_async(two_idle_steps_after_restart, timeout=30, what="a step after the restart")
        after = (await steps(state))[recorded]
        assert after.observation.request_rate == 0
        assert after.decision.forecast.request_rate > 0
    finally:
        planner.terminate()
        planner.wait(timeout=15)


async def test_a_look_grows_a_fleet_far_behind_before_the_interval_ends(nats_url, nc, tmp_path):
    """Decision 65, live: the planner decides every 60 s and looks every second. The frontends report
    that nearly every request misses its TTFT; within seconds, long before its first decision, it
    asks `kvmesh up`'s supervisor (the test answers on its subject) for more workers."""
    profile, state = tmp_path / "profile.json", tmp_path / "planner.sqlite"
    profile_mock_engine().save(profile)
    pools = {"aggregated": 2}
    asked: list[dict] = []

    async def supervisor(message) -> None:
        body = json.loads(message.data)
        if body:  # a resize; an empty body asks for the pools
            asked.append(body)
            pools.update(body)
        await message.respond(json.dumps(pools).encode())

    await nc.subscribe(names.planner_scale_subject(NAMESPACE), cb=supervisor)
    await nc.flush()
    planner = service_process(
        "planner",
        nats_url,
        NAMESPACE,
        "--engine-profile", str(profile),
        "--state-db", str(state),
        "--connector", "local",
        "--adjustment-interval", "60",
        "--growth-look-secs", "1",
        "--metrics-port", "-1",
    )  # fmt: skip
    try:
        missed = RequestSample(2000, 32, 500, 5000.0, 12.0)  # a 5 s first token: far past the 2 s target

        async def grown() -> bool:
            report = LoadReport("frontend-test", 0.0, 0.25, 5, (missed,) * 5)
            await nc.publish(names.load_report_subject(NAMESPACE), report.encode())
            await nc.flush()
            await asyncio.sleep(0.25)
            return bool(asked)

        await wait_until_async(grown, timeout=30, what="a look that grows the fleet")
        assert asked[0]["aggregated"] > 2
        assert await steps(state) == []  # no decision yet: the interval has not ended
    finally:
        planner.terminate()
        planner.wait(timeout=15)
