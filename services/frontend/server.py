"""The frontend service: the OpenAI-compatible HTTP API in front of the router replicas."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
import uvicorn

from kvmesh.common.discovery import DiscoveryWatcher
from kvmesh.common.runtime import connect_nats
from kvmesh.common.service import service_main
from kvmesh.frontend.app import Frontend, ServedModel, create_app
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.router_client import RouterClient
from kvmesh.frontend.tokenizer import ModelTokenizer

log = structlog.get_logger(__name__)


async def serve(config: FrontendConfig, stop: asyncio.Event) -> None:
    model = ServedModel(config.model_name, ModelTokenizer(Path(config.model_path)), int(time.time()))
    nc = await connect_nats(config.nats_url, name="kvmesh-frontend")
    watcher = None
    if config.router_address:
        routers = RouterClient(fixed_address=config.router_address)
    else:
        watcher = DiscoveryWatcher(nc.jetstream(), config.namespace, "router")
        await watcher.start()
        routers = RouterClient(watcher=watcher)
    frontend = Frontend(model, routers, default_max_tokens=config.default_max_tokens)
    app = create_app(frontend)
    # Bind the socket ourselves so a busy port is reported clearly before anything else starts.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this: without it small responses wait on delayed ACKs (~40 ms).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((config.http_host, config.http_port))
    except OSError as exc:
        raise SystemExit(f"frontend: cannot listen on {config.http_host}:{config.http_port}: {exc}") from exc
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    server.install_signal_handlers = lambda: None  # our own handlers drive shutdown
    task = asyncio.create_task(server.serve(sockets=[sock]))
    port = sock.getsockname()[1]
    log.info("frontend ready", url=f"http://{config.http_host}:{port}/v1", model=config.model_name)
    try:
        done, _ = await asyncio.wait({task, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await task
        await routers.close()
        if watcher is not None:
            await watcher.stop()
        await nc.close()


def main(argv: Sequence[str] | None = None) -> None:
    service_main(
        FrontendConfig,
        argv,
        service="frontend",
        description="Run the OpenAI-compatible HTTP facade (/v1/chat/completions, /v1/completions, ...).",
        serve=serve,
    )
