"""Start a ``grpc.aio`` server with the standard health-checking and reflection services."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.common.rpc import grpc_tls

# Large prompts are long token lists; the 4 MiB default would cap a request at about a million tokens.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Keepalive: a peer on a host that lost power or its link sends no RST; without pings a stream to it
# waits for ever. Each side pings an idle connection every KEEPALIVE_MS and gives it up when the
# answer takes KEEPALIVE_TIMEOUT_MS, so a call on a dead connection fails within about ten seconds
# (and a stream moves elsewhere). The server accepts pings that often, also between calls.
KEEPALIVE_MS = 5000
KEEPALIVE_TIMEOUT_MS = 5000
_MESSAGE_SIZES = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
CHANNEL_OPTIONS = [*_MESSAGE_SIZES, *_KEEPALIVE]
SERVER_OPTIONS = [
    *_MESSAGE_SIZES,
    # gRPC's default lets a second server bind a port already bound: two services given one port
    # would then share its connections silently. Refuse instead.
    ("grpc.so_reuseport", 0),
    *_KEEPALIVE,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
]


class GrpcService:
    """A running gRPC server: its bound port and the health servicer to flip to NOT_SERVING."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer

    async def stop(self, grace: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def start_grpc_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    host: str = "127.0.0.1",
    port: int = 0,
) -> GrpcService:
    """Build, register and start a server on ``host:port`` (0 picks a free port)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    credentials = grpc_tls.current().server_credentials()
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError:  # grpcio raises on a busy port where older versions returned 0
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port} (address in use?)")
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return GrpcService(server, bound, health_servicer)


def channel_to(address: str) -> grpc.aio.Channel:
    """A channel to ``address``: plain text, or TLS where this process's gRPC TLS policy names a CA
    (:mod:`kvmesh.common.rpc.grpc_tls`)."""
    credentials = grpc_tls.current().channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
