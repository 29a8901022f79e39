"""``docker-compose.host.yml`` brought up for real on a Docker engine, driven with the openai client,
one worker container restarted under load, then torn down.

Needs an engine and the kvmesh image (``scripts/local-docker.sh up``); skips and says so otherwise.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from kvmesh.planner.connectors import ComposeService, ConnectorError
from kvmesh.planner.decision import PoolSizes
from tests.containers.docker_engine import KVMESH_IMAGE, compose_command, require_kvmesh_image
from tests.support import (
    api_answers,
    assert_every_stream_whole,
    discovered,
    free_port,
    metric_value,
    streams_interrupted_by,
    wait_until,
)

pytestmark = [pytest.mark.containers, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
MODEL = "kvmesh-tiny"
PROMPT = "Explain how a KV-cache aware router decides where to send a request. " * 3


@dataclass
class ComposeMesh:
    """A running compose project: how to reach it and how to run compose commands on it."""

    command: list[str]
    env: dict[str, str]
    nats_url: str
    api: str

    def compose(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.command, *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=True
        )

    def container_started_at(self, service: str) -> str:
        (container_id,) = self.compose("ps", "-q", service).stdout.split()
        inspect = ["docker", "inspect", "--format", "{{.State.StartedAt}}", container_id]
        return subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def compose_mesh() -> Iterator[ComposeMesh]:
    require_kvmesh_image()
    command = compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    nats_port, monitor_port, http_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "KVMESH_NATS_PORT": str(nats_port),
        "KVMESH_NATS_MONITOR_PORT": str(monitor_port),
        "KVMESH_HTTP_PORT": str(http_port),
        "KVMESH_IMAGE": KVMESH_IMAGE,
    }
    project = f"kvmesh-test-{uuid.uuid4().hex[:8]}"
    mesh = ComposeMesh(
        command=[*command, "--project-name", project, "--file", str(REPO / "docker-compose.host.yml")],
        env=env,
        nats_url=f"nats://127.0.0.1:{nats_port}",
        api=f"http://127.0.0.1:{http_port}/v1",
    )
    try:
        mesh.compose("up", "--detach", timeout=180)
        wait_until(lambda: len(discovered(mesh.nats_url, "worker")) == 2, timeout=60, what="two workers registered")
        wait_until(lambda: api_answers(mesh.api), timeout=60, what="the frontend to answer")
        yield mesh
    except BaseException:
        print(mesh.compose("logs", "--no-color", "--tail", "40").stdout)
        raise
    finally:
        mesh.compose("down", "--volumes", "--timeout", "10")


def router_migrations(mesh: ComposeMesh) -> float:
    """The router's count of streams continued on another worker (from its Prometheus endpoint)."""
    (router,) = discovered(mesh.nats_url, "router")
    return metric_value(router.extra["metrics"], "kvmesh_router_migrations_total", 0.0)


def client(mesh: ComposeMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=30)


def test_chat_and_streaming_through_the_containers(compose_mesh):
    completion = client(compose_mesh).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=7
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 7

    stream = client(compose_mesh).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello again"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 9  # one byte-level token per character
    assert chunks[-1].usage.completion_tokens == 9


def test_a_repeated_prompt_is_served_from_cache(compose_mesh):
    first = client(compose_mesh).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4
    )
    # The worker's BlockStored events reach the indexer over JetStream: wait for the router to see
    # them (a later request reports cached tokens) rather than assuming they arrived.
    cached: list[int] = []

    def second_hits_cache() -> bool:
        again = client(compose_mesh).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4
        )
        cached.append(again.usage.prompt_tokens_details.cached_tokens)
        return cached[-1] > 0

    wait_until(second_hits_cache, timeout=20, what="a repeated prompt to report cached tokens")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < cached[-1] <= first.usage.prompt_tokens


def test_restarting_a_worker_container_under_load_loses_no_request(compose_mesh):
    # streams longer than the worker's 2 s shutdown grace, so the restart cuts some mid-flight
    streams, max_tokens, restart_after = 40, 1500, 20
    started_before = compose_mesh.container_started_at("worker-1")

    async def restart() -> None:
        # SIGTERM through tini, then the same container again: its streams continue on the other worker
        await asyncio.to_thread(compose_mesh.compose, "restart", "--timeout", "10", "worker-1")

    results = asyncio.run(
        streams_interrupted_by(
            compose_mesh.api, restart, streams=streams, max_tokens=max_tokens, after_started=restart_after
        )
    )
    assert_every_stream_whole(results, streams, max_tokens)
    assert compose_mesh.container_started_at("worker-1") != started_before, "worker-1 was not restarted"
    # the restart cut streams mid-flight, and the router continued them on the other worker
    assert router_migrations(compose_mesh) > 0
    wait_until(
        lambda: len(discovered(compose_mesh.nats_url, "worker")) == 2,
        timeout=60,
        what="the restarted worker to register again",
    )


def test_the_planner_compose_connector_grows_and_shrinks_the_pool_losing_no_request(compose_mesh):
    pool = ComposeService(compose_mesh.command, {"aggregated": "worker"}, env=compose_mesh.env)
    assert asyncio.run(pool.current(PoolSizes())) == PoolSizes(aggregated=0)  # none until asked
    assert asyncio.run(pool.scale(PoolSizes(aggregated=1))) == PoolSizes(aggregated=1)
    wait_until(
        lambda: len(discovered(compose_mesh.nats_url, "worker")) == 3,
        timeout=60,
        what="the pool's worker to register beside worker-1 and worker-2",
    )
    shrunk: list[PoolSizes] = []

    async def shrink() -> None:
        shrunk.append(await pool.scale(PoolSizes(aggregated=0)))

    streams, max_tokens = 30, 400
    results = asyncio.run(
        streams_interrupted_by(compose_mesh.api, shrink, streams=streams, max_tokens=max_tokens, after_started=15)
    )
    assert shrunk == [PoolSizes(aggregated=0)]
    assert_every_stream_whole(results, streams, max_tokens)
    wait_until(
        lambda: len(discovered(compose_mesh.nats_url, "worker")) == 2,
        timeout=60,
        what="the pool's worker to deregister",
    )


def test_the_disaggregated_compose_connector_sizes_prefill_and_decode_pools_losing_no_request(compose_mesh):
    pools = ComposeService(
        compose_mesh.command, {"prefill": "prefill-worker", "decode": "worker"}, env=compose_mesh.env
    )
    assert asyncio.run(pools.current(PoolSizes())) == PoolSizes(prefill=0, decode=0)
    # naming the disagg profile's service starts it without the profile
    assert asyncio.run(pools.scale(PoolSizes(prefill=2, decode=1))) == PoolSizes(prefill=2, decode=1)

    def roles() -> list[str]:
        return sorted(record.role or "aggregated" for record in discovered(compose_mesh.nats_url, "worker"))

    wait_until(
        lambda: roles() == ["aggregated"] * 3 + ["prefill"] * 2,
        timeout=60,
        what="two prefill workers and the decode pool's worker to register",
    )
    shrunk: list[PoolSizes] = []

    async def shrink() -> None:
        shrunk.append(await pools.scale(PoolSizes(prefill=1, decode=0)))

    streams, max_tokens = 30, 200
    results = asyncio.run(
        streams_interrupted_by(compose_mesh.api, shrink, streams=streams, max_tokens=max_tokens, after_started=15)
    )
    assert shrunk == [PoolSizes(prefill=1, decode=0)]
    assert_every_stream_whole(results, streams, max_tokens)
    wait_until(
        lambda: roles() == ["aggregated"] * 2 + ["prefill"],
        timeout=60,
        what="the removed prefill and decode workers to deregister",
    )
    asyncio.run(pools.scale(PoolSizes(prefill=0, decode=0)))
    wait_until(lambda: roles() == ["aggregated"] * 2, timeout=60, what="the prefill pool to empty")


def test_the_compose_connector_says_what_failed(compose_mesh):
    pool = ComposeService(compose_mesh.command, {"aggregated": "no-such-service"}, env=compose_mesh.env)
    with pytest.raises(ConnectorError, match="no-such-service"):
        asyncio.run(pool.scale(PoolSizes(aggregated=1)))
