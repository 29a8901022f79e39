"""How the planner's decisions reach the fleet.

``local``: the ``kvmesh up`` supervisor, over NATS request/reply on ``kvmesh.<ns>.planner.scale``
(JSON ``{"aggregated": 0, "prefill": P, "decode": D}`` sets the pools; ``{}`` asks their sizes; the
answer names every role's size, or carries ``"error"``; see ``kvmesh.worker_pool``).
``compose``: each pool is one docker compose service's replicas (the aggregated pool, or with
``--disaggregated`` the prefill and the decode pool). Scaling runs ``<compose> up --detach --no-deps
--no-recreate --scale SERVICE=N ... SERVICE ...``, which starts containers up to N or stops the
highest-numbered ones; a stopped kvmesh worker gets SIGTERM (``init: true`` forwards it), deregisters
at once and finishes its streams within the service's ``stop_grace_period``, so scaling down loses
no request. The pool's size is the number of the service's containers that run.
``kubernetes``: each pool is one Deployment, resized through the Kubernetes API from inside the
cluster (``kvmesh.planner.kubernetes``).
``no-operation``: nothing is changed; the decisions are only logged and recorded.
(The replay has its own, virtual one: ``kvmesh.replay.fleet``.)
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient

from kvmesh.common.calling.worker_caches import departure_costs
from kvmesh.common.runtime.discovery import registered_now
from kvmesh.common.wire import names
from kvmesh.common.wire.worker_key import POD_KEY
from kvmesh.planner.connector import Connector, ConnectorError, by_pool
from kvmesh.planner.decision import POOLS, PoolSizes
from kvmesh.planner.kubernetes import Departures, KubernetesDeployments

CONNECTORS = ("local", "compose", "kubernetes", "no-operation")
__all__ = [
    "CONNECTORS",
    "ComposeService",
    "Connector",
    "ConnectorError",
    "LocalSupervisor",
    "NoOperation",
    "make_connector",
]


class NoOperation:
    async def current(self, registered: PoolSizes) -> PoolSizes:
        return registered

    async def scale(self, target: PoolSizes) -> PoolSizes:
        return target


class LocalSupervisor:
    """Asks ``kvmesh up --planner``'s supervisor; it counts the workers it started, registered or not."""

    def __init__(self, nc: NatsClient, namespace: str, timeout: float = 5.0) -> None:
        self._nc = nc
        self._subject = names.planner_scale_subject(namespace)
        self._timeout = timeout

    async def _ask(self, body: dict[str, int]) -> PoolSizes:
        try:
            reply = await self._nc.request(self._subject, json.dumps(body).encode(), timeout=self._timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise ConnectorError(
                f"no kvmesh up supervisor answers on {self._subject} (is `kvmesh up --planner` running?)"
            ) from exc
        try:
            answer = json.loads(reply.data)
            if "error" in answer:
                raise ConnectorError(f"the supervisor refused: {answer['error']}")
            return PoolSizes(**{role: int(answer.get(role, 0)) for role in POOLS})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConnectorError(f"bad answer from the supervisor: {reply.data[:200]!r}") from exc

    async def current(self, registered: PoolSizes) -> PoolSizes:
        return await self._ask({})

    async def scale(self, target: PoolSizes) -> PoolSizes:
        return await self._ask({role: getattr(target, role) for role in POOLS})


COMMAND_TIMEOUT_S = 300.0  # a scale-up may build nothing but still start several containers


def compose_command() -> list[str] | None:
    """``docker compose`` (the v2 plugin) where installed, else the standalone ``docker-compose``."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


class ComposeService:
    """Scales compose services, one per pool (``{"aggregated": "worker"}``, or ``{"prefill":
    "prefill-worker", "decode": "worker"}``). Guarantees: :meth:`scale` returns only once compose has
    started or stopped the containers (a failed or hung compose command raises
    :class:`ConnectorError` with its output); the sizes it reports are counted from the engine, never
    assumed."""

    def __init__(
        self,
        compose: Sequence[str],
        services: Mapping[str, str],
        files: Sequence[str] = (),
        project: str = "",
        timeout: float = COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.services = by_pool(services, "compose services")
        self._compose = [*compose, *(arg for f in files for arg in ("--file", f))]
        if project:
            self._compose += ["--project-name", project]
        self._timeout = timeout
        self._env = dict(env) if env is not None else None  # None: this process's environment

    async def current(self, registered: PoolSizes) -> PoolSizes:
        return PoolSizes(**{pool: await self._running(service) for pool, service in self.services.items()})

    async def scale(self, target: PoolSizes) -> PoolSizes:
        scales = [
            arg for pool, service in self.services.items() for arg in ("--scale", f"{service}={getattr(target, pool)}")
        ]
        named = list(self.services.values())
        await self._run(*self._compose, "up", "--detach", "--no-deps", "--no-recreate", *scales, *named)
        return await self.current(target)

    async def _running(self, service: str) -> int:
        containers = (await self._run(*self._compose, "ps", "-q", service)).split()
        if not containers:
            return 0
        states = await self._run("docker", "inspect", "--format", "{{.State.Running}}", *containers)
        return states.split().count("true")

    async def _run(self, *argv: str) -> str:
        shown = shlex.join(argv)
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self._env
            )
        except OSError as exc:
            raise ConnectorError(f"cannot run `{shown}`: {exc}") from exc
        try:
            out, err = await asyncio.wait_for(process.communicate(), self._timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise ConnectorError(f"`{shown}` took longer than {self._timeout:g} s") from None
        if process.returncode != 0:
            detail = (err or out).decode(errors="replace").strip()[-800:]
            raise ConnectorError(f"`{shown}` failed (exit {process.returncode}): {detail}")
        return out.decode(errors="replace")


def make_connector(config: Any, nc: NatsClient) -> Connector:
    """The connector ``config.connector_name()`` names, set up from ``config``'s options."""
    name = config.connector_name()
    if name == "local":
        return LocalSupervisor(nc, config.namespace)
    if name == "compose":
        compose = shlex.split(config.compose_command) if config.compose_command else compose_command()
        if not compose:
            raise ConnectorError("--connector compose: neither `docker compose` nor `docker-compose` is installed")
        files = [f for f in config.compose_file.split(",") if f]
        if config.disaggregated:
            services = {"prefill": config.compose_prefill_service, "decode": config.compose_service}
        else:
            services = {"aggregated": config.compose_service}
        return ComposeService(compose, services, files, config.compose_project)
    if name == "kubernetes":
        if config.disaggregated:
            deployments = {"prefill": config.kubernetes_prefill_deployment, "decode": config.kubernetes_deployment}
        else:
            deployments = {"aggregated": config.kubernetes_deployment}
        blocks = config.kubernetes_departure_blocks
        return KubernetesDeployments(
            deployments,
            config.kubernetes_namespace,
            config.kubernetes_credentials,
            departures=pod_departures(nc, config.namespace, blocks) if blocks else None,
        )
    if name == "no-operation":
        return NoOperation()
    raise ValueError(f"unknown connector {name!r}; choose one of {', '.join(CONNECTORS)}")


def pod_departures(nc: NatsClient, namespace: str, hot_blocks: int) -> Departures:
    """For a pool, what each of its worker pods would lose by leaving: how many of its ``hot_blocks``
    hottest cached blocks no other worker of the pool holds. Workers that name no pod (no
    ``--pod-name``) or do not answer are left out."""

    async def costs(pool: str) -> dict[str, int]:
        try:
            records = await registered_now(nc.jetstream(), namespace, "worker")
        except Exception as exc:  # NATS unreachable or slow: the ReplicaSet picks this time
            raise ConnectorError(f"cannot list the workers in discovery: {type(exc).__name__}: {exc}") from exc
        in_pool = [r for r in records if (r.role or "aggregated") == pool]
        pods = [r for r in in_pool if r.extra.get(POD_KEY)]
        lost = await departure_costs(pods, in_pool, hot_blocks)
        return {str(r.extra[POD_KEY]): lost[r.instance_id] for r in pods if r.instance_id in lost}

    return costs
