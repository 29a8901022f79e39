"""What every kvmesh service process does around its own logic: parse its config, set up logging,
run until signalled; and, for gRPC services, serve (with health and reflection) and stay registered
in discovery while serving."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import structlog
from nats.js import JetStreamContext

from kvmesh.common.config import CommonConfig, GrpcEndpointConfig, describe, parse_config
from kvmesh.common.discovery import InstanceRecord, Registration
from kvmesh.common.grpc_server import start_grpc_server
from kvmesh.common.logging import configure_logging
from kvmesh.common.runtime import run_until_signalled

log = structlog.get_logger(__name__)

ConfigT = TypeVar("ConfigT", bound=CommonConfig)


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
    log.info(f"starting {service}", config=describe(config))
    run_until_signalled(lambda stop: serve(config, stop))


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
) -> AsyncIterator[InstanceRecord]:
    """Serve gRPC and keep this instance registered; on exit, deregister first, then stop serving,
    so that nobody is sent to an address that is going away."""
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
        yield record
    finally:
        await registration.stop()
        await server.stop()
