"""Prometheus endpoints of the gRPC services (the frontend serves /metrics on its HTTP port)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, start_http_server

from kvmesh.common.runtime.config import GrpcEndpointConfig, advertised_host


class MetricsEndpoint:
    """``/metrics`` for one registry on ``--metrics-port``; its address goes into discovery."""

    def __init__(self, config: GrpcEndpointConfig, registry: CollectorRegistry) -> None:
        self.address: str | None = None
        self._server = None
        if config.metrics_port >= 0:
            self._server, _thread = start_http_server(config.metrics_port, addr=config.host, registry=registry)
            self.address = f"{advertised_host(config)}:{self._server.server_port}"

    def discovery_extra(self) -> dict[str, str]:
        return {"metrics": self.address} if self.address else {}

    async def close(self) -> None:
        """Stop serving. ``shutdown`` waits up to the HTTP server's 0.5 s poll interval, so it runs in
        a thread instead of stalling the service's event loop (and its other shutdown steps)."""
        if self._server is not None:
            server, self._server = self._server, None
            await asyncio.to_thread(server.shutdown)
            server.server_close()
