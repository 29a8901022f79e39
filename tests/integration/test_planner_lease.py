"""One planner acts at a time: the lease (a key in a replicated NATS KV bucket whose age limit is the
lease period) is held by one owner at any moment; a holder that stops hands it over at once, one that
dies is replaced within two periods. Two real `kvmesh planner run` processes: only the holder records
decisions, and after kill -9 of it the other takes over, never deciding while the first still could."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.runtime.lease import Lease
from kvmesh.common.wire import names
from kvmesh.profiler.mock import profile_mock_engine
from kvmesh.worker.engines.mock.mock_engine import EngineConfig
from tests.support import service_process, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "leasing"
PERIOD_S = 2.0


async def test_one_holder_at_a_time_handover_on_stop_and_takeover_after_death(nc: NatsClient):
    js = nc.jetstream()
    first = Lease(js, "TEST_LEASE", "k", "first", PERIOD_S)
    second = Lease(js, "TEST_LEASE", "k", "second", PERIOD_S)
    await first.start()
    await second.start()
    both_held = 0
    sampling = True

    async def sample() -> None:
        nonlocal both_held
        while sampling:
            both_held += first.held() and second.held()
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    try:
        assert first.held() and not second.held()
        await first.stop()  # hands over at once
        started = time.monotonic()
        await wait_until_async(second.held, timeout=PERIOD_S, what="the standby takes the released lease")
        assert time.monotonic() - started < PERIOD_S / 2
        third = Lease(js, "TEST_LEASE", "k", "third", PERIOD_S)
        await third.start()
        assert not third.held()
        # the holder dies: it writes no more and deletes nothing
        assert second._task is not None
        await cancel_and_wait(second._task)
        died = time.monotonic()
        await wait_until_async(third.held, timeout=3 * PERIOD_S, what="a standby takes over")
        assert time.monotonic() - died <= 2 * PERIOD_S
        assert not second.held()  # its belief ran out before the key did
        await third.stop()
    finally:
        sampling = False
        await sampler
    assert both_held == 0


def planner_process(nats_url: str, profile, state) -> subprocess.Popen[bytes]:
    return service_process(
        "planner",
        nats_url,
        NAMESPACE,
        "--engine-profile", str(profile),
        "--state-db", str(state),
        "--connector", "no-operation",
        "--adjustment-interval", "0.5",
        "--planner-lease-secs", str(PERIOD_S),
        "--metrics-port", "-1",
    )  # fmt: skip


def decision_times(state) -> list[float]:
    if not state.exists():
        return []
    with sqlite3.connect(state) as db:
        try:
            return [row[0] for row in db.execute("SELECT at_s FROM steps ORDER BY id")]
        except sqlite3.OperationalError:  # not made yet
            return []


async def lease_owner(nc: NatsClient) -> str | None:
    try:
        kv = await nc.jetstream().key_value(names.PLANNER_LEASE_BUCKET)
        entry = await kv.get(f"{NAMESPACE}.planner")
    except Exception:
        return None
    return entry.value.decode() if entry.value else None


async def test_two_planners_one_acts_and_the_other_takes_over_after_kill_9(nats_url, nc, tmp_path):
    profile = tmp_path / "profile.json"
    profile_mock_engine(EngineConfig()).save(profile)
    state_a, state_b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    first = planner_process(nats_url, profile, state_a)
    second = None
    try:
        await wait_until_async(lambda: len(decision_times(state_a)) >= 2, timeout=30, what="the first decides")
        second = planner_process(nats_url, profile, state_b)
        decided = len(decision_times(state_a))
        # while the first lives, it alone decides: the second only stands by
        await wait_until_async(lambda: len(decision_times(state_a)) >= decided + 6, timeout=30, what="6 more")
        assert decision_times(state_b) == []
        assert f":{first.pid}:" in (await lease_owner(nc) or "")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        killed = time.time()

        async def second_holds() -> bool:
            return f":{second.pid}:" in (await lease_owner(nc) or "")

        await wait_until_async(second_holds, timeout=3 * PERIOD_S, what="the second takes the lease")
        took_over = time.time() - killed
        assert took_over <= 2 * PERIOD_S
        await wait_until_async(lambda: decision_times(state_b), timeout=10, what="the second decides")
        # never two at once: every decision of the first came before any of the second
        assert max(decision_times(state_a)) <= killed < min(decision_times(state_b))
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                os.kill(process.pid, signal.SIGTERM)
                process.wait(timeout=30)


async def test_the_standby_takes_over_with_the_history_of_the_planner_it_replaces(nats_url, nc, tmp_path):
    """``--state-store nats``: the two replicas share their steps through JetStream (a pod's own disk
    dies with it), so the standby that takes the lease resumes from every step the dead one recorded."""
    from kvmesh.planner.step_stream import JetStreamSteps

    profile = tmp_path / "profile.json"
    profile_mock_engine(EngineConfig()).save(profile)
    namespace = "leasing-shared"
    logs = {who: tmp_path / f"{who}.log" for who in ("first", "second")}

    def shared_planner(who: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable, "-m", "kvmesh.planner", "--nats-url", nats_url, "--namespace", namespace,
                "--log-level", "info", "--engine-profile", str(profile), "--state-store", "nats",
                "--connector", "no-operation", "--adjustment-interval", "0.5",
                "--planner-lease-secs", str(PERIOD_S), "--metrics-port", "-1",
            ],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=logs[who].open("wb"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def resumed_steps(who: str) -> list[int]:
        events = [json.loads(line) for line in logs[who].read_text().splitlines() if line.startswith("{")]
        return [e["steps"] for e in events if e.get("event") == "resumed"]

    async with JetStreamSteps(nc, namespace) as steps:
        first = shared_planner("first")
        second = None
        try:
            await wait_until_async(lambda: steps.count(), timeout=30, what="the first records a step")
            second = shared_planner("second")
            await wait_until_async(
                lambda: b"standing by" in logs["second"].read_bytes(), timeout=30, what="the second stands by"
            )
            recorded = await steps.count()
            await wait_until_async(_more_than(steps, recorded + 4), timeout=30, what="more steps by the first")
            before = len(resumed_steps("second"))  # at its start, from what the first had recorded then
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=10)
            at_kill = await steps.count()
            await wait_until_async(
                lambda: len(resumed_steps("second")) > before, timeout=4 * PERIOD_S, what="the second resumes"
            )
            assert resumed_steps("second")[-1] == at_kill  # every step the first recorded, to the last
            await wait_until_async(_more_than(steps, at_kill), timeout=10, what="the second records steps")
            times = [s.decision.at_s for s in await steps.recent(10_000)]
            assert times == sorted(times)  # one history, carried on
        finally:
            for process in (first, second):
                if process is not None and process.poll() is None:
                    os.kill(process.pid, signal.SIGTERM)
                    process.wait(timeout=30)


def _more_than(steps, count: int):
    async def check() -> bool:
        return await steps.count() > count

    return check
