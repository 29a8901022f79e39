"""The Docker engine the container tests run on, and containers of the kvmesh image on it.

The tests use whatever engine ``DOCKER_HOST`` (or the default socket) names. On machines with no
registry access and no bridge network, ``scripts/local-docker.sh up`` starts one and builds the
``kvmesh:latest`` image; there every container uses the host's network and listens on 127.0.0.1.
On an ordinary engine, NATS comes from the official image with a published port.

Without an engine or the image the tests skip and say why; with ``KVMESH_REQUIRE_DOCKER=1`` (set by
``.ci/run`` once it has started the engine) they fail instead, so CI cannot pass by skipping them.
"""

from __future__ import annotations

import functools
import os

import pytest

# testcontainers starts a reaper (Ryuk) container unless told not to; its image cannot be pulled here,
# and every test removes its own containers anyway. Read when testcontainers is imported.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

from testcontainers.core.container import DockerContainer
from testcontainers.core.wait_strategies import LogMessageWaitStrategy

from kvmesh.planner.connectors import compose_command

KVMESH_IMAGE = os.environ.get("KVMESH_IMAGE", "kvmesh:latest")
NATS_IMAGE = os.environ.get("KVMESH_TEST_NATS_IMAGE", "nats:2.11")
HOW_TO_START = "start one with `scripts/local-docker.sh up` and `eval $(scripts/local-docker.sh env)`"

__all__ = [
    "KVMESH_IMAGE",
    "compose_command",
    "engine_has_bridge",
    "kvmesh_container",
    "nats_container",
    "nats_url_of",
    "require_engine",
    "require_kvmesh_image",
]


@functools.cache
def _engine_problem() -> str | None:
    """Why no Docker engine can be used, or None when one answers."""
    try:
        import docker

        docker.from_env(timeout=10).ping()
    except Exception as error:  # any failure to reach the engine means the same: no engine
        where = os.environ.get("DOCKER_HOST", "the default socket")
        return f"no Docker engine answers at {where} ({type(error).__name__}); {HOW_TO_START}"
    return None


def _unavailable(reason: str) -> None:
    if os.environ.get("KVMESH_REQUIRE_DOCKER") == "1":
        pytest.fail(f"KVMESH_REQUIRE_DOCKER=1 but {reason}")
    pytest.skip(reason)


def require_engine() -> None:
    """Skip (or fail, under ``KVMESH_REQUIRE_DOCKER=1``) unless a Docker engine answers."""
    problem = _engine_problem()
    if problem:
        _unavailable(problem)


def require_kvmesh_image() -> None:
    """Also require the kvmesh image, which the tests never build themselves (it takes a minute)."""
    require_engine()
    import docker

    try:
        docker.from_env().images.get(KVMESH_IMAGE)
    except docker.errors.ImageNotFound:
        _unavailable(f"no {KVMESH_IMAGE} image on the engine; build it with `scripts/local-docker.sh image`")


@functools.cache
def engine_has_bridge() -> bool:
    """Whether containers can get their own network (False on a ``--bridge=none`` engine)."""
    import docker

    return bool(docker.from_env().networks.list(names=["bridge"]))


def kvmesh_container(*args: str, nats_url: str) -> DockerContainer:
    """``kvmesh <args>`` in a container of the kvmesh image on the host's network."""
    return (
        DockerContainer(KVMESH_IMAGE)
        .with_command(list(args))
        .with_env("KVMESH_NATS_URL", nats_url)
        .with_env("KVMESH_LOG_LEVEL", "info")
        .with_kwargs(network_mode="host", init=True)
    )


def nats_container(port: int) -> tuple[DockerContainer, str]:
    """A JetStream NATS server container (not yet started) and the URL it will answer on.

    On a bridge-less engine it runs from the kvmesh image on the host's network at 127.0.0.1:``port``;
    elsewhere from the official NATS image, its port published wherever the engine chooses (the URL
    is then known only once started: use :func:`nats_url_of`)."""
    ready = LogMessageWaitStrategy("Server is ready").with_poll_interval(0.1).with_startup_timeout(30)
    if engine_has_bridge():
        container = DockerContainer(NATS_IMAGE).with_command("-js").with_exposed_ports(4222).waiting_for(ready)
        return container, ""
    # JetStream's store on a tmpfs: a test's streams are small, and the container's overlay
    # filesystem is the slowest disk a CI machine has.
    container = (
        DockerContainer(KVMESH_IMAGE)
        .with_command(["-js", "-sd", "/jetstream", "-a", "127.0.0.1", "-p", str(port)])
        .with_kwargs(network_mode="host", entrypoint="nats-server")
        .with_tmpfs_mount("/jetstream", "size=256m")
        .waiting_for(ready)
    )
    return container, f"nats://127.0.0.1:{port}"


def nats_url_of(container: DockerContainer, planned_url: str) -> str:
    """The URL of a started :func:`nats_container` (started means ready: it waits for the server)."""
    if planned_url:
        return planned_url
    return f"nats://{container.get_container_host_ip()}:{container.get_exposed_port(4222)}"
