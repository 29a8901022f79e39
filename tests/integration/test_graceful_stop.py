"""SIGTERM (a clean stop: ``docker stop``, a rolling restart) of a worker or a router replica under
load loses no request: the stopping service deregisters, serves its open streams for --drain-timeout-secs,
and whatever it has not finished by then continues elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import Iterator

import pytest

from kvmesh.common.runtime.ports import free_port
from tests.support import (
    StreamedAnswer,
    api_answers,
    assert_every_stream_whole,
    discovered,
    metric_value,
    service_process,
    streams_interrupted_by,
    wait_until,
)

pytestmark = pytest.mark.integration
NAMESPACE = "graceful"
STREAMS = 30
STOP_AFTER_STARTED = 15
# longer than the victims' 1 s drain at real-time speed, so the stop cuts streams mid-flight
MAX_TOKENS = 500


@contextlib.contextmanager
def processes(*started: subprocess.Popen[bytes]) -> Iterator[list[subprocess.Popen[bytes]]]:
    running = list(started)
    try:
        yield running
    finally:
        for process in running:
            if process.poll() is None:
                process.terminate()
        for process in running:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


def frontend(nats_url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    web = service_process("frontend", nats_url, NAMESPACE, "--http-port", str(port))
    return web, f"http://127.0.0.1:{port}/v1"


def wait_for(nats_url: str, component: str, count: int) -> None:
    wait_until(
        lambda: len(discovered(nats_url, component, NAMESPACE)) == count,
        timeout=30,
        what=f"{count} {component} instance(s)",
    )


async def load_and_stop(api: str, victim: subprocess.Popen[bytes]) -> list[StreamedAnswer]:
    """STREAMS streaming chats; SIGTERM ``victim`` once STOP_AFTER_STARTED of them have begun."""

    async def stop() -> None:
        victim.send_signal(signal.SIGTERM)

    results = await streams_interrupted_by(
        api, stop, streams=STREAMS, max_tokens=MAX_TOKENS, after_started=STOP_AFTER_STARTED
    )
    assert await asyncio.to_thread(victim.wait, 30) == 0, "the stopped service did not exit cleanly"
    return results


def stop_a_worker_under_load(nats_url: str, drain_secs: int) -> float:
    """SIGTERM one of two workers (given ``drain_secs`` to drain) under load; every answer must be
    whole. Returns the router's migrations (made by the frontend and reported to it)."""
    worker_args = ("--speedup-ratio", "1", "--lease-ttl", "30")
    victim = service_process("worker", nats_url, NAMESPACE, *worker_args, "--drain-timeout-secs", str(drain_secs))
    web, api = frontend(nats_url)
    with processes(
        service_process("router", nats_url, NAMESPACE),
        service_process("worker", nats_url, NAMESPACE, *worker_args),
        victim,
        web,
    ):
        wait_for(nats_url, "worker", 2)
        wait_for(nats_url, "router", 1)
        wait_until(lambda: api_answers(api), timeout=30, what="the frontend to answer")
        assert_every_stream_whole(asyncio.run(load_and_stop(api, victim)), STREAMS, MAX_TOKENS)
        return router_migrations(nats_url)


def test_a_worker_stopped_under_load_loses_no_request(nats_url: str):
    # the drain cut streams, and they moved
    assert stop_a_worker_under_load(nats_url, drain_secs=1) > 0


def test_a_router_replica_stopped_under_load_loses_no_request(nats_url: str):
    victim = service_process("router", nats_url, NAMESPACE, "--lease-ttl", "30", "--drain-timeout-secs", "1")
    web, api = frontend(nats_url)
    with processes(
        victim,
        service_process("router", nats_url, NAMESPACE, "--lease-ttl", "30"),
        service_process("worker", nats_url, NAMESPACE, "--speedup-ratio", "1"),
        service_process("worker", nats_url, NAMESPACE, "--speedup-ratio", "1"),
        web,
    ):
        wait_for(nats_url, "worker", 2)
        wait_for(nats_url, "router", 2)
        wait_until(lambda: api_answers(api), timeout=30, what="the frontend to answer")
        assert_every_stream_whole(asyncio.run(load_and_stop(api, victim)), STREAMS, MAX_TOKENS)


def router_migrations(nats_url: str) -> float:
    (router,) = discovered(nats_url, "router", NAMESPACE)
    return metric_value(router.extra["metrics"], "kvmesh_router_migrations_total")


def test_a_worker_given_time_to_drain_finishes_its_own_streams(nats_url: str):
    # --drain-timeout-secs longer than the streams: the stopping worker takes no new request but
    # finishes every one it has, so none has to move (the short drain cuts and migrates them); the
    # frontend holds the worker's stream: it must close it once the worker left
    assert stop_a_worker_under_load(nats_url, drain_secs=60) == 0
