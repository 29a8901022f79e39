"""Fixtures: a real NATS server per test (embedded binary, or a testcontainers container when a
Docker engine answers and ``KVMESH_TEST_NATS=container``)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.nats_server import EmbeddedNatsServer


def _container_nats() -> Iterator[str]:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    container = DockerContainer("nats:2.11").with_command("-js").with_exposed_ports(4222)
    with container:
        wait_for_logs(container, "Server is ready", timeout=30)
        yield f"nats://{container.get_container_host_ip()}:{container.get_exposed_port(4222)}"


@pytest.fixture
async def nats_url() -> AsyncIterator[str]:
    if os.environ.get("KVMESH_TEST_NATS") == "container":
        gen = _container_nats()
        url = next(gen)
        try:
            yield url
        finally:
            next(gen, None)
        return
    server = await EmbeddedNatsServer().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    client = await nats.connect(nats_url)
    try:
        yield client
    finally:
        await client.close()
