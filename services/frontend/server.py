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

from kvmesh.common.calling.request_path import RequestPath
from kvmesh.common.calling.router_client import RouterClient
from kvmesh.common.rpc.grpc_server import start_grpc_server
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.heap import freeze_startup_heap
from kvmesh.common.runtime.service import ServiceStack, service_main
from kvmesh.common.wire.lora import adapters_of
from kvmesh.frontend.admission import read_api_keys
from kvmesh.frontend.app import create_app
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.endpoint_picker import EXT_PROC_SERVICE, EndpointPicker, ext_proc_grpc
from kvmesh.frontend.gateway import Frontend, ServedModel
from kvmesh.frontend.load_window import publish_load_forever
from kvmesh.frontend.tokenizer import ModelTokenizer

log = structlog.get_logger(__name__)


MODEL_CHECK_SECS = 2.0
# How long an idle keep-alive connection stays open. It must outlast the clients' own idle expiry:
# httpx (under the openai client) reuses a connection idle for up to 5 s, and uvicorn's default of
# 5 s closed such a connection just as a request went out on it, which failed that request with
# a connection error (seen once in a drill). 75 s is what common proxies keep.
KEEP_ALIVE_SECS = 75


async def check_model_served_forever(frontend: Frontend, workers: DiscoveryWatcher) -> None:
    """Say once (log, metric, /health) when workers are registered and none serves this frontend's
    model: every request would then be refused."""
    while True:
        await asyncio.sleep(MODEL_CHECK_SECS)
        models = sorted({w.model for w in workers.instances()})
        name = frontend.model.name
        if models and name not in models:
            frontend.findings.found(
                "unknown_model",
                name,
                f"this frontend serves model {name!r} (--model-name), but the workers serve "
                f"{', '.join(repr(m) for m in models)}: every request will be refused; give the frontend one of "
                "those names, or start workers with --model-name " + repr(name),
            )
        else:
            frontend.findings.resolved("unknown_model", name)


async def serve(config: FrontendConfig, stop: asyncio.Event) -> None:
    model = ServedModel(config.model_name, ModelTokenizer(Path(config.model_path)), int(time.time()))
    async with ServiceStack() as stack:
        nc = await stack.nats(config, "kvmesh-frontend")
        routers = RouterClient(fixed_address=config.router_address)
        stack.push_async_callback(routers.close)
        if not config.router_address:
            await stack.start(routers.watch(nc.jetstream(), config.namespace))
        path = RequestPath(routers)
        stack.push_async_callback(path.close)
        workers = await stack.start(path.watch(nc.jetstream(), config.namespace))
        frontend = Frontend(model, path, default_max_tokens=config.default_max_tokens)
        frontend.adapters = lambda: adapters_of(workers.instances(), model.name)
        stack.task(check_model_served_forever(frontend, workers), "check-model")
        stack.task(publish_load_forever(nc, config.namespace, frontend.load, config.load_report_secs), "publish-load")
        sock = listening_socket(config.http_host, config.http_port)
        stack.callback(sock.close)
        api_keys = read_api_keys(config.api_key, config.api_key_file)
        app = create_app(frontend, api_keys, config.max_request_body_bytes, config.max_concurrent_requests)
        server = uvicorn.Server(
            uvicorn.Config(
                app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=KEEP_ALIVE_SECS
            )
        )
        server.install_signal_handlers = lambda: None  # our own handlers drive shutdown
        task = asyncio.create_task(server.serve(sockets=[sock]))

        async def stop_serving() -> None:
            server.should_exit = True
            with contextlib.suppress(Exception):
                await task

        stack.push_async_callback(stop_serving)
        if config.ext_proc_port >= 0:
            picker = EndpointPicker(frontend, routers, workers.instances)
            ext_proc = await start_grpc_server(
                lambda server: ext_proc_grpc.add_ExternalProcessorServicer_to_server(picker, server),
                [EXT_PROC_SERVICE],
                config.http_host,
                config.ext_proc_port,
            )
            stack.push_async_callback(ext_proc.stop)
            log.info("endpoint picker ready", ext_proc=f"{config.http_host}:{ext_proc.port}")
        port = sock.getsockname()[1]
        log.info(
            "frontend ready",
            url=f"http://{config.http_host}:{port}/v1",
            model=config.model_name,
            api_keys=len(api_keys),
            max_concurrent_requests=config.max_concurrent_requests or None,
        )
        freeze_startup_heap()
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if task in done:
            task.result()


def listening_socket(host: str, port: int) -> socket.socket:
    """Bind the socket ourselves, so a busy port is reported clearly before anything else starts."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this: without it small responses wait on delayed ACKs (~40 ms).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"frontend: cannot listen on {host}:{port}: {exc}") from exc
    return sock


def main(argv: Sequence[str] | None = None) -> None:
    service_main(
        FrontendConfig,
        argv,
        service="frontend",
        description="Run the OpenAI-compatible HTTP facade (/v1/chat/completions, /v1/completions, ...).",
        serve=serve,
    )
