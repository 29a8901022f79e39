"""Replica-failover drill on containers (testcontainers): a mesh of containers of the kvmesh image,
two indexer replicas and two router replicas among them; under load, the container of one indexer
replica and of one router replica is killed. Every stream still ends whole (answers stream from the
workers; a try routed at the dead replica fails over to the other), and KV-aware routing goes on
with the surviving indexer replica.

Needs an engine and the kvmesh image (``scripts/local-docker.sh up``); skips and says so otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from testcontainers.core.container import DockerContainer

from tests.containers.docker_engine import (
    engine_has_bridge,
    kvmesh_container,
    nats_container,
    nats_url_of,
    require_kvmesh_image,
)
from tests.support import (
    api_answers,
    assert_every_stream_whole,
    discovered,
    free_port,
    streams_interrupted_by,
    wait_until,
)

pytestmark = [pytest.mark.containers, pytest.mark.timeout(300)]
PROMPT = "Explain how a KV-cache aware router decides where to send a request. " * 3


@dataclass
class ContainerMesh:
    nats_url: str
    api: str
    indexers: list[DockerContainer]
    routers: list[DockerContainer]
    frontend: DockerContainer


@pytest.fixture(scope="module")
def container_mesh() -> Iterator[ContainerMesh]:
    require_kvmesh_image()
    if engine_has_bridge():
        pytest.skip("the drill runs its containers on the host's network, for bridge-less engines")
    http_port = free_port()
    with contextlib.ExitStack() as stack:
        nats, planned_url = nats_container(free_port())
        stack.enter_context(nats)
        nats_url = nats_url_of(nats, planned_url)

        def start(*args: str) -> DockerContainer:
            return stack.enter_context(kvmesh_container(*args, nats_url=nats_url))

        indexers = [start("indexer", "--replica-id", str(replica)) for replica in (0, 1)]
        routers = [start("router", "--router-replica-sync", "--lease-ttl", "2") for _ in range(2)]
        for _ in range(2):
            start("worker", "--speedup-ratio", "0.3")  # slow streams: still running when the kill lands
        frontend = start("frontend", "--http-port", str(http_port))
        mesh = ContainerMesh(nats_url, f"http://127.0.0.1:{http_port}/v1", indexers, routers, frontend)
        try:
            for component, count in (("indexer", 2), ("router", 2), ("worker", 2)):
                wait_until(
                    lambda c=component, n=count: len(discovered(nats_url, c)) == n,
                    timeout=60,
                    what=f"{count} {component} containers registered",
                )
            wait_until(lambda: api_answers(mesh.api), timeout=60, what="the frontend container to answer")
            yield mesh
        except BaseException:
            for container in [*indexers, *routers, frontend]:
                stdout, stderr = container.get_logs()
                print((stdout + stderr).decode(errors="replace")[-2000:])
            raise


def cached_tokens(api: str) -> int:
    client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=30)
    completion = client.chat.completions.create(
        model="kvmesh-tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=4
    )
    return completion.usage.prompt_tokens_details.cached_tokens


def test_killing_an_indexer_and_a_router_container_under_load_loses_no_request(container_mesh):
    streams, max_tokens = 60, 200

    async def kill_replicas() -> None:
        container_mesh.indexers[0].get_wrapped_container().kill()  # SIGKILL: no clean deregistration
        container_mesh.routers[0].get_wrapped_container().kill()

    results = asyncio.run(
        streams_interrupted_by(
            container_mesh.api, kill_replicas, streams=streams, max_tokens=max_tokens, after_started=20
        )
    )
    assert_every_stream_whole(results, streams, max_tokens)

    # the killed replicas' leases run out, and KV-aware routing goes on with the surviving indexer
    wait_until(lambda: len(discovered(container_mesh.nats_url, "router")) == 1, timeout=30, what="router lease expiry")
    wait_until(lambda: cached_tokens(container_mesh.api) > 0, timeout=30, what="a repeated prompt served from cache")
