"""Running the mesh: start every service, wait until it serves, restart what dies, stop it all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import httpx
import structlog
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import router_pb2, router_pb2_grpc
from kvmesh.common.rpc.grpc_server import channel_to
from kvmesh.common.rpc.grpc_tls import GrpcTls
from kvmesh.common.runtime.config import describe, parse_config
from kvmesh.common.runtime.discovery import DiscoveryWatcher, InstanceRecord
from kvmesh.common.runtime.jetstream_state import configure_replicas
from kvmesh.common.runtime.nats_auth import NatsCredentials
from kvmesh.common.runtime.nats_cluster import EmbeddedNatsCluster
from kvmesh.common.runtime.nats_server import NatsServerError
from kvmesh.common.runtime.process import connect_nats
from kvmesh.common.runtime.run_file import RunRecord, remove_run_record, write_run_record
from kvmesh.common.runtime.structured_logging import configure_logging
from kvmesh.up.config import UpConfig
from kvmesh.up.planner_pools import plan_planner, serve_worker_pool
from kvmesh.up.processes import AUTO_POOL, ServiceProcess, kv_pool_directory, plan_services
from kvmesh.worker.engines.vllm.vllm_defaults import require_vllm
from kvmesh.worker_pool import WorkerPools

log = structlog.get_logger(__name__)

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


async def wait_until_ready(config: UpConfig, nats_url: str, services: list[ServiceProcess]) -> None:
    """Wait for every instance to register, for every router replica to see every registered worker
    and for the HTTP API to answer /health: a request sent after this returns, one naming its worker
    too, finds that worker known to whichever router takes it."""
    nc = await connect_nats(
        nats_url,
        name="kvmesh-up",
        first_connect_timeout=config.nats_connect_timeout,
        credentials=NatsCredentials.from_config(config),
    )
    js = nc.jetstream()
    expected = {"worker": config.workers + config.prefill_workers, "indexer": config.indexers, "router": config.routers}
    watchers = {c: DiscoveryWatcher(js, config.namespace, c) for c in expected}
    timeout = config.resolved_startup_timeout()
    deadline = time.monotonic() + timeout
    try:
        for watcher in watchers.values():
            await watcher.start()
        while True:
            for service in services:
                code = service.exited()
                if code is not None:
                    raise RuntimeError(f"{service.name} exited with code {code} during start-up")
            counts = {c: len(w.instances()) for c, w in watchers.items()}
            registered = all(counts[c] >= n for c, n in expected.items())
            seen = registered and await routers_see_workers(
                watchers["router"].instances(), watchers["worker"].instances()
            )
            if seen and await _http_healthy(config):
                return
            if time.monotonic() > deadline:
                waiting = "the HTTP API" if seen else "a router to see every worker" if registered else "registration"
                raise RuntimeError(f"mesh not ready after {timeout}s (waiting for {waiting}): registered {counts}")
            await asyncio.sleep(0.1)
    finally:
        for watcher in watchers.values():
            await watcher.stop()
        await nc.close()


async def routers_see_workers(routers: list[InstanceRecord], workers: list[InstanceRecord]) -> bool:
    """Whether every router replica's load view lists every worker in ``workers``. Discovery tells the
    routers of a worker a moment after it registers; on a busy machine (engines still warming up
    beside the router) later than it tells us, and a request naming a worker the router has not
    seen yet is refused as naming no registered worker."""
    wanted = {record.instance_id for record in workers}
    for router in routers:
        try:
            async with channel_to(router.address) as channel:
                status = await router_pb2_grpc.RouterStub(channel).GetStatus(
                    router_pb2.RouterStatusRequest(), timeout=1.0
                )
        except grpc.aio.AioRpcError:
            return False
        if not wanted <= {load.worker_id for load in status.loads}:
            return False
    return True


async def _http_healthy(config: UpConfig) -> bool:
    try:
        async with httpx.AsyncClient(timeout=1.0) as client:
            response = await client.get(f"http://{config.http_host}:{config.http_port}/health")
            return response.status_code == 200
    except httpx.HTTPError:
        return False


def _api_base(config: UpConfig) -> str:
    host = "127.0.0.1" if config.http_host in ("0.0.0.0", "") else config.http_host
    return f"http://{host}:{config.http_port}"


def _ready_banner(config: UpConfig, nats_url: str, run_file: Path) -> str:
    base = _api_base(config)
    return (
        f"kvmesh is up: {config.workers} worker(s), {config.indexers} indexer(s), {config.routers} router(s), "
        f"router mode {config.router_mode}\n"
        f"  OpenAI API: {base}/v1   model: {config.model_name}\n"
        f"  NATS: {nats_url}   namespace: {config.namespace}\n"
        f"  recorded in {run_file}: kvmesh inspect, kvmesh bench and the client find this mesh\n"
        f"  try: curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{config.model_name}", "messages": [{{"role": "user", "content": "hi"}}]}}\'\n'
        f"  stop with Ctrl-C"
    )


async def run(config: UpConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    nats: EmbeddedNatsCluster | None = None
    nats_url = config.nats_url
    # The services inherit our environment: NATS credentials and the gRPC TLS files reach them there,
    # off their command lines.
    os.environ.update(NatsCredentials.from_config(config).environment())
    grpc_tls_setting = GrpcTls(cert=config.grpc_tls_cert, key=config.grpc_tls_key, ca=config.grpc_tls_ca)
    os.environ.update(grpc_tls_setting.environment())
    if nats_url is None:
        nats = await EmbeddedNatsCluster(config.nats_cluster).start()
        nats_url = nats.url
        log.info(
            "embedded NATS started",
            url=nats_url,
            servers=len(nats.nodes),
            store=nats.store_dir,
            pids=[node.pid for node in nats.nodes],
        )
    services: list[ServiceProcess] = []
    pool: WorkerPools | None = None
    supervisor: NatsClient | None = None
    # the planner's engine profile and default state file: a fresh directory each run, so nothing in
    # it outlives the mesh (a later `kvmesh up` never reads it; --planner-state-db keeps a state file)
    planner_dir: Path | None = None
    exit_code = 0
    # everything after NATS starts is undone in the `finally`: a plan that fails (a file that cannot
    # be written, an engine profile that cannot be measured) leaves no server or directory behind
    try:
        if config.kv_pool:
            kv_pool_directory(config).mkdir(parents=True, exist_ok=True)
        services = plan_services(config, nats_url)
        if config.planner:
            planner_dir = Path(tempfile.mkdtemp(prefix="kvmesh-planner-"))
            planner_process, pool = plan_planner(config, nats_url, services, planner_dir)
            services.append(planner_process)
        if pool is not None:
            supervisor = await serve_worker_pool(config, nats_url, pool)
        for service in services:
            service.start()
        ready = asyncio.create_task(wait_until_ready(config, nats_url, services))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return 0
        ready.result()
        record = RunRecord(
            nats_url,
            config.namespace,
            f"{_api_base(config)}/v1",
            os.getpid(),
            str(pool.state_db) if pool is not None and pool.state_db else None,
        )
        run_file = write_run_record(record)
        print(_ready_banner(config, nats_url, run_file), flush=True)
        restarts: list[float] = []
        while not stop.is_set():
            for service in services:
                code = service.exited()
                if code is None:
                    continue
                # A crashed replica is restarted (failover drills kill them on purpose); a crash loop
                # stops the mesh rather than spinning.
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < RESTART_WINDOW_S]
                if len(restarts) >= MAX_RESTARTS:
                    log.error("services keep crashing; stopping the mesh", service=service.name, code=code)
                    return 1
                restarts.append(now)
                log.warning("a service exited; restarting it", service=service.name, code=code)
                service.kill_leftovers()
                service.start()
            for node in nats.exited() if nats is not None else []:
                # On the same port and store: JetStream recovers from disk (and, in a cluster, catches
                # up from the other replicas); the services reconnect (their reconnects are unlimited)
                # and the workers' publishers resend what failed.
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < RESTART_WINDOW_S]
                if len(restarts) >= MAX_RESTARTS:
                    log.error("the NATS server keeps exiting; stopping the mesh", url=node.url)
                    return 1
                restarts.append(now)
                log.warning("a NATS server exited; restarting it on the same port and store", url=node.url)
                try:
                    await node.restart()
                except NatsServerError as exc:
                    log.error("the NATS server did not restart; stopping the mesh", url=node.url, error=str(exc))
                    return 1
                log.info("NATS server restarted", url=node.url, pid=node.pid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
        log.info("stopping the mesh")
    except (RuntimeError, OSError) as exc:
        log.error("start-up failed", error=str(exc))
        exit_code = 1
    finally:
        if supervisor is not None:
            await supervisor.close()
        stopping = pool.stopping if pool is not None else []
        for service in [*reversed(services), *stopping]:
            service.terminate()
        deadline = time.monotonic() + 10.0
        for service in [*reversed(services), *stopping]:
            service.wait_or_kill(deadline)
        if nats is not None:
            nats.stop()
        if planner_dir is not None:
            shutil.rmtree(planner_dir, ignore_errors=True)
        if config.kv_pool == AUTO_POOL:  # segments of killed workers outlive them until here
            shutil.rmtree(kv_pool_directory(config), ignore_errors=True)
        remove_run_record(config.namespace, os.getpid())
        log.info("all services stopped")
    return exit_code


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(
        UpConfig,
        argv,
        prog="kvmesh up",
        description="Start a whole kvmesh on this machine: NATS, indexer, router, mock workers, frontend.",
    )
    if config.engine == "vllm":
        require_vllm(split_roles=config.prefill_workers > 0)
    configure_logging(config.log_level, config.log_json, service="up")
    configure_replicas(config.jetstream_replicas)
    log.info("starting kvmesh", config=describe(config))
    sys.exit(asyncio.run(run(config)))
