"""What every kvmesh service process does around its own logic: parse its config, set up logging,
run until signalled; hold what it acquires in a :class:`ServiceStack` that releases it in reverse
order; and, for gRPC services, serve (with health and reflection) and stay registered in discovery
while serving."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc
import structlog
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from kvmesh.common.rpc import grpc_tls
from kvmesh.common.rpc.grpc_server import start_grpc_server
from kvmesh.common.rpc.tasks import cancel_and_wait
from kvmesh.common.runtime.config import CommonConfig, GrpcEndpointConfig, describe, parse_config
from kvmesh.common.runtime.discovery import InstanceRecord, Registration
from kvmesh.common.runtime.heap import own_process_heap
from kvmesh.common.runtime.jetstream_state import configure_replicas
from kvmesh.common.runtime.nats_auth import NatsCredentials
from kvmesh.common.runtime.process import connect_nats, run_until_signalled
from kvmesh.common.runtime.structured_logging import configure_logging

log = structlog.get_logger(__name__)

ConfigT = TypeVar("ConfigT", bound=CommonConfig)


class Startable(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


StartableT = TypeVar("StartableT", bound=Startable)


class ServiceStack(contextlib.AsyncExitStack):
    """Everything a service acquires while it starts, released in reverse order when it stops —
    and when start-up fails part-way, so a half-started service leaks no connection, task or port.

        async with ServiceStack() as stack:
            nc = await stack.nats(config, "kvmesh-router-1")
            watcher = await stack.start(DiscoveryWatcher(...))
            registration = await stack.grpc_service(js, config, ...)   # registered last, deregistered first
            await stop.wait()
    """

    async def nats(self, config: CommonConfig, name: str) -> NatsClient:
        nc = await connect_nats(
            config.nats_url,
            name=name,
            first_connect_timeout=config.nats_connect_timeout,
            credentials=NatsCredentials.from_config(config),
        )
        self.push_async_callback(nc.close)
        return nc

    async def start(self, component: StartableT) -> StartableT:
        """``await component.start()`` now, ``await component.stop()`` on the way out."""
        await component.start()
        self.push_async_callback(component.stop)
        return component

    def task(self, coroutine: Awaitable[None], name: str) -> asyncio.Task[None]:
        """A background task, cancelled and awaited on the way out."""
        task = asyncio.ensure_future(coroutine)
        task.set_name(name)
        self.push_async_callback(cancel_and_wait, task)
        return task

    async def grpc_service(self, js: JetStreamContext, config: GrpcEndpointConfig, **kwargs: Any) -> Registration:
        """Serve gRPC and stay registered until the stack unwinds (see :func:`registered_grpc_service`);
        the registration's record can be updated while serving."""
        return await self.enter_async_context(registered_grpc_service(js, config, **kwargs))


def service_main(
    config_class: type[ConfigT],
    argv: Sequence[str] | None,
    *,
    service: str,
    description: str,
    serve: Callable[[ConfigT, asyncio.Event], Awaitable[None]],
) -> None:
    """``kvmesh <service>``: typed config from flags and env, logging, run until SIGINT / SIGTERM."""
    config = parse_config(config_class, argv, prog=f"kvmesh {service}", description=description)
    configure_logging(config.log_level, config.log_json, service=service)
    configure_grpc_tls(config)
    configure_replicas(config.jetstream_replicas)
    log.info(f"starting {service}", config=describe(config))
    own_process_heap()  # the service freezes its startup heap once ready (docs/decisions/0028)
    run_until_signalled(lambda stop: serve(config, stop))


def configure_grpc_tls(config: Any) -> None:
    """This process's gRPC TLS policy from the service's options (a missing file is a clear error)."""
    setting = grpc_tls.GrpcTls(
        cert=getattr(config, "grpc_tls_cert", None),
        key=getattr(config, "grpc_tls_key", None),
        ca=getattr(config, "grpc_tls_ca", None),
    )
    try:
        grpc_tls.configure(setting)
    except ValueError as exc:
        raise SystemExit(f"gRPC TLS: {exc}") from exc


@contextlib.asynccontextmanager
async def registered_grpc_service(
    js: JetStreamContext,
    config: GrpcEndpointConfig,
    *,
    component: str,
    instance_id: int,
    service_name: str,
    add_servicer: Callable[[grpc.aio.Server], None],
    **record_fields: Any,
) -> AsyncIterator[Registration]:
    """Serve gRPC and keep this instance registered; on exit, deregister first, then stop serving:
    no new call is accepted, the calls in flight have ``config.drain_timeout_secs`` to finish, and
    nobody is sent to an address that is going away."""
    server = await start_grpc_server(add_servicer, [service_name], host=config.host, port=config.port)
    record = InstanceRecord(
        component=component,
        instance_id=instance_id,
        address=config.advertised_address(server.port),
        namespace=config.namespace,
        lease_ttl=config.lease_ttl,
        **record_fields,
    )
    registration = Registration(js, record)
    try:
        await registration.start()
        yield registration
    finally:
        await registration.stop()
        log.info("draining", calls_may_take_secs=config.drain_timeout_secs)
        await server.stop(config.drain_timeout_secs)
