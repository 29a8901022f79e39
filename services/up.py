"""``kvmesh up``: a whole working mesh on one machine, one process per service.

Starts an embedded NATS server (or uses ``--nats-url``), the indexer replicas, the router, the mock
workers and the frontend; waits until every one has registered and the HTTP API answers; says where
to send requests. A service that crashes is restarted (at most five restarts a minute, then the mesh
stops). Ctrl-C or SIGTERM stops every child (SIGTERM, then SIGKILL after a grace period),
and the children are also tied to this process's life by the kernel (``PR_SET_PDEATHSIG``), so even
a ``kill -9`` of ``kvmesh up`` leaves no orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import structlog
from nats.aio.client import Client as NatsClient

from kvmesh.common import names
from kvmesh.common.child_process import ending_with_parent
from kvmesh.common.config import CommonConfig, ConfigError, describe, option, options_argv, parse_config
from kvmesh.common.discovery import DiscoveryWatcher
from kvmesh.common.grpc_tls import GrpcTls
from kvmesh.common.nats_auth import NatsCredentials
from kvmesh.common.nats_server import EmbeddedNatsServer, NatsServerError
from kvmesh.common.run_file import RunRecord, remove_run_record, write_run_record
from kvmesh.common.runtime import connect_nats
from kvmesh.common.structured_logging import configure_logging
from kvmesh.common.timing import TimingModel
from kvmesh.common.tiny_model import MODEL_DIR, MODEL_NAME
from kvmesh.planner.planner import PlannerOptions
from kvmesh.profiler.mock import profile_mock_engine
from kvmesh.router.config import RouterOptions
from kvmesh.worker.mock_engine import EngineConfig
from kvmesh.worker_pool import WorkerPool, WorkerPools

log = structlog.get_logger(__name__)

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


@dataclass
class UpConfig(CommonConfig, RouterOptions, PlannerOptions):
    """``kvmesh up``'s own options; every router option (``RouterOptions``) is taken too and handed to
    the router replicas unchanged, and with ``--planner`` every planner option to the planner."""

    nats_url: str | None = option(None, "use this NATS server instead of starting an embedded one")
    http_host: str = option("127.0.0.1", "address of the HTTP API")
    http_port: int = option(8000, "port of the OpenAI-compatible HTTP API")
    engine: str = option(
        "mock",
        "workers' engine: the simulated mock, or vLLM (vLLM's own engine arguments, such as --model or "
        "--max-model-len, follow the flags and go to every worker; no --model: the tiny random-weight Llama)",
        choices=("mock", "vllm"),
    )
    workers: int = option(2, "number of workers (decode workers when --prefill-workers is set)")
    prefill_workers: int = option(
        0, "number of prefill-role mock workers; with any, the other workers run as decode workers (disaggregation)"
    )
    num_layers: int = option(2, "model layers of the mock workers' KV buffer (bytes a KV transfer moves per token)")
    kv_transfer_backend: str = option(
        "auto", "workers' KV transfer backend (auto: NIXL when installed)", choices=("auto", "nixl", "tcp")
    )
    kv_pool: bool = option(
        False,
        "mock workers share a host KV pool in /dev/shm: each writes the blocks it computes there and imports the "
        "blocks it lacks, so a request that moves to another worker resumes without recomputing its prompt",
    )
    indexers: int = option(1, "number of indexer replicas")
    routers: int = option(1, "number of router replicas behind the frontend")
    api_key: str | None = option(
        None, "API keys the HTTP API requires as 'Authorization: Bearer <key>' (comma-separated)", secret=True
    )
    api_key_file: str | None = option(None, "file of API keys, one per line")
    max_concurrent_requests: int = option(0, "HTTP requests in flight at once; more get a 503 (0: no limit)")
    grpc_tls_cert: str | None = option(
        None, "certificate every gRPC server of the mesh presents (TLS on its request path)"
    )
    grpc_tls_key: str | None = option(None, "its private key")
    router_snapshot_threshold: int = option(1_000_000, "indexer snapshot threshold (stream messages)")
    block_size: int | None = option(None, "tokens per KV block of the workers (default: the engine's own)")
    num_gpu_blocks: int | None = option(
        None, "KV blocks per worker (default: the engine's own)", flag="--num-gpu-blocks-override"
    )
    speedup_ratio: float = option(1.0, "mock engine speed-up (divides simulated step times)")
    model_name: str = option(MODEL_NAME, "model name served")
    model_path: str = option(str(MODEL_DIR), "model directory (tokenizer.json, tokenizer_config.json)")
    startup_timeout: float | None = option(
        None, "seconds to wait for every service to come up (default: 60, or 600 with --engine vllm)"
    )
    planner: bool = option(
        False,
        "run the SLA planner: it resizes the worker pool (from --workers, within --min-workers / --max-workers) "
        "to meet --ttft-target-ms and --itl-target-ms; with --prefill-workers, the prefill and decode pools apart",
    )
    planner_state_db: Path | None = option(None, "the planner's SQLite state file (default: a new one in a temp dir)")
    engine_args: list[str] = option(None, "with --engine vllm: vLLM engine arguments for the workers", passthrough=True)

    def resolved_startup_timeout(self) -> float:
        # a vLLM worker loads (or first builds) its model and profiles its memory before it registers
        if self.startup_timeout is not None:
            return self.startup_timeout
        return 600.0 if self.engine == "vllm" else 60.0

    def validate(self) -> None:
        RouterOptions.validate(self)
        if self.engine == "mock" and self.engine_args:
            unknown = " ".join(self.engine_args)
            raise ConfigError(f"unrecognized arguments: {unknown} (engine arguments need --engine vllm)")
        if self.workers < 1:
            raise ConfigError("--workers must be at least 1")
        if self.indexers < 1:
            raise ConfigError("--indexers must be at least 1")
        if self.routers < 1:
            raise ConfigError("--routers must be at least 1")
        if self.prefill_workers < 0:
            raise ConfigError("--prefill-workers must be >= 0")
        if self.kv_pool and self.engine != "mock":
            raise ConfigError("--kv-pool is for mock workers (vLLM manages its own KV memory)")
        if self.planner:
            PlannerOptions.validate(self)
            if self.engine != "mock":
                raise ConfigError("--planner sizes pools of mock workers (no --engine vllm)")
            if not self.min_workers <= self.workers <= self.max_workers:
                raise ConfigError("--planner: --workers must lie within --min-workers and --max-workers")
            if self.prefill_workers and not 1 <= self.min_workers <= self.prefill_workers <= self.max_workers:
                # an empty prefill pool would silently end disaggregation, hence at least one
                raise ConfigError(
                    "--planner with --prefill-workers: need 1 <= --min-workers <= --prefill-workers <= --max-workers"
                )


class ServiceProcess:
    """One child service process."""

    def __init__(self, name: str, module: str, args: list[str], env: dict[str, str] | None = None) -> None:
        """``env``: added to the environment it inherits (secrets go there, not on its command line,
        which every user of the machine can read)."""
        self.name = name
        self.argv = [sys.executable, "-m", module, *args]
        self.env = {**os.environ, **env} if env else None
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # A process group of its own: what the service spawns (vLLM's engine core) goes with it
        self.process = subprocess.Popen(ending_with_parent(self.argv), start_new_session=True, env=self.env)
        log.info("started", service=self.name, pid=self.process.pid)

    def kill_leftovers(self) -> None:
        """SIGKILL whatever is left of the service's process group once the service itself is gone
        (a crashed vLLM worker leaves its engine core process behind, holding memory and CPU)."""
        if self.process is not None and self.process.poll() is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def wait_or_kill(self, deadline: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("did not stop in time; killing", service=self.name)
            self.process.kill()
            self.process.wait()
        self.kill_leftovers()


def plan_services(config: UpConfig, nats_url: str) -> list[ServiceProcess]:
    common = common_args(config, nats_url)
    services = [
        ServiceProcess(
            f"indexer-{i}",
            "kvmesh.indexer",
            [*common, "--replica-id", str(i), "--router-snapshot-threshold", str(config.router_snapshot_threshold)],
        )
        for i in range(config.indexers)
    ]
    router_args = [*common, *options_argv(RouterOptions, config)]
    services += [ServiceProcess(f"router-{i}", "kvmesh.router", router_args) for i in range(config.routers)]
    role = "decode" if config.prefill_workers else "aggregated"
    services += [worker_process(config, common, i, role) for i in range(config.workers)]
    services += [worker_process(config, common, i, "prefill") for i in range(config.prefill_workers)]
    services.append(
        ServiceProcess(
            "frontend",
            "kvmesh.frontend",
            [
                *common,
                "--http-host",
                config.http_host,
                "--http-port",
                str(config.http_port),
                "--model-name",
                config.model_name,
                "--model-path",
                config.model_path,
                *(["--load-report-secs", str(min(5.0, config.adjustment_interval / 2))] if config.planner else []),
                *(["--api-key-file", config.api_key_file] if config.api_key_file else []),
                "--max-concurrent-requests",
                str(config.max_concurrent_requests),
            ],
            env={"KVMESH_API_KEY": config.api_key} if config.api_key else None,
        )
    )
    return services


def common_args(config: UpConfig, nats_url: str) -> list[str]:
    common = ["--nats-url", nats_url, "--namespace", config.namespace, "--log-level", config.log_level]
    if config.log_json is not None:
        common.append("--log-json" if config.log_json else "--no-log-json")
    if config.nats_connect_timeout is not None:
        common += ["--nats-connect-timeout", str(config.nats_connect_timeout)]
    return common


def kv_pool_directory(config: UpConfig) -> Path:
    """This mesh's KV pool: in /dev/shm (shared memory) where the host has it; removed when the mesh stops."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"kvmesh-pool-{config.namespace}-{os.getpid()}"


def worker_process(config: UpConfig, common: list[str], index: int, role: str) -> ServiceProcess:
    worker_args = [
        *common,
        "--engine",
        config.engine,
        "--model-name",
        config.model_name,
        *(["--block-size", str(config.block_size)] if config.block_size else []),
        *(["--num-gpu-blocks-override", str(config.num_gpu_blocks)] if config.num_gpu_blocks else []),
        "--speedup-ratio",
        str(config.speedup_ratio),
        "--kv-transfer-backend",
        config.kv_transfer_backend,
        "--num-layers",
        str(config.num_layers),
        *(["--kv-pool", str(kv_pool_directory(config))] if config.kv_pool else []),
        *config.engine_args,
    ]
    name = f"worker-{index}" if role != "prefill" else f"prefill-worker-{index}"
    return ServiceProcess(name, "kvmesh.worker", [*worker_args, "--role", role])


def plan_planner(config: UpConfig, nats_url: str, services: list[ServiceProcess]) -> tuple[ServiceProcess, WorkerPools]:
    """The planner process (with a profile of the workers' mock engine, measured now) and the pools
    it resizes through this supervisor: the aggregated workers, or the prefill and the decode ones."""
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-planner-"))
    engine = EngineConfig(
        num_blocks=config.num_gpu_blocks or 16384,
        block_size=config.block_size or 16,
        timing=TimingModel(speedup_ratio=config.speedup_ratio),
    )
    profile_path = workdir / "engine-profile.json"
    profile_mock_engine(engine).save(profile_path)
    state_db = config.planner_state_db or workdir / "planner.sqlite"
    common = common_args(config, nats_url)
    planner = ServiceProcess(
        "planner",
        "kvmesh.planner",
        [
            *common,
            *options_argv(PlannerOptions, config),
            "--engine-profile",
            str(profile_path),
            "--state-db",
            str(state_db),
            "--connector",
            "local",
            *(["--disaggregated"] if config.prefill_workers else []),
        ],
    )

    def pool(role: str, prefix: str) -> WorkerPool:
        workers = [s for s in services if s.name.startswith(prefix)]
        return WorkerPool(
            services,
            workers,
            lambda index: worker_process(config, common, index, role),
            config.min_workers,
            config.max_workers,
            role,
        )

    if config.prefill_workers:
        pools = WorkerPools({"prefill": pool("prefill", "prefill-worker-"), "decode": pool("decode", "worker-")})
    else:
        pools = WorkerPools({"aggregated": pool("aggregated", "worker-")})
    pools.state_db = state_db
    log.info("planner planned", state_db=str(state_db), profile=str(profile_path), pools=pools.sizes())
    return planner, pools


async def serve_worker_pool(config: UpConfig, nats_url: str, pool: WorkerPools) -> NatsClient:
    """Answer the planner's scale requests (the local connector's supervisor side)."""
    nc = await connect_nats(
        nats_url,
        name="kvmesh-up-supervisor",
        first_connect_timeout=config.nats_connect_timeout,
        credentials=NatsCredentials.from_config(config),
    )
    namespace = config.namespace

    async def on_request(message) -> None:
        await message.respond(pool.answer(message.data))

    await nc.subscribe(names.planner_scale_subject(namespace), cb=on_request)
    return nc


async def wait_until_ready(config: UpConfig, nats_url: str, services: list[ServiceProcess]) -> None:
    """Wait for every instance to register and for the HTTP API to answer /health."""
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
            if all(counts[c] >= n for c, n in expected.items()) and await _http_healthy(config):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"mesh not ready after {timeout}s: registered {counts}")
            await asyncio.sleep(0.1)
    finally:
        for watcher in watchers.values():
            await watcher.stop()
        await nc.close()


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

    nats_server: EmbeddedNatsServer | None = None
    nats_url = config.nats_url
    # The services inherit our environment: NATS credentials and the gRPC TLS files reach them there,
    # off their command lines.
    os.environ.update(NatsCredentials.from_config(config).environment())
    grpc_tls_setting = GrpcTls(cert=config.grpc_tls_cert, key=config.grpc_tls_key, ca=config.grpc_tls_ca)
    os.environ.update(grpc_tls_setting.environment())
    if nats_url is None:
        nats_server = await EmbeddedNatsServer().start()
        nats_url = nats_server.url
        log.info("embedded NATS server started", url=nats_url, store=nats_server.store_dir, pid=nats_server.pid)
    if config.kv_pool:
        kv_pool_directory(config).mkdir(parents=True, exist_ok=True)
    services = plan_services(config, nats_url)
    pool: WorkerPools | None = None
    supervisor: NatsClient | None = None
    if config.planner:
        planner_process, pool = plan_planner(config, nats_url, services)
        services.append(planner_process)
    exit_code = 0
    try:
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
            if nats_server is not None and nats_server.exited():
                # On the same port and store: JetStream recovers from disk, the services reconnect
                # (their reconnects are unlimited) and the workers' publishers resend what failed.
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < RESTART_WINDOW_S]
                if len(restarts) >= MAX_RESTARTS:
                    log.error("the NATS server keeps exiting; stopping the mesh")
                    return 1
                restarts.append(now)
                log.warning("the NATS server exited; restarting it on the same port and store", url=nats_url)
                try:
                    await nats_server.restart()
                except NatsServerError as exc:
                    log.error("the NATS server did not restart; stopping the mesh", error=str(exc))
                    return 1
                log.info("NATS server restarted", url=nats_url, pid=nats_server.pid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
        log.info("stopping the mesh")
    except RuntimeError as exc:
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
        if nats_server is not None:
            nats_server.stop()
        if config.kv_pool:  # segments of killed workers outlive them until here
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
    configure_logging(config.log_level, config.log_json, service="up")
    log.info("starting kvmesh", config=describe(config))
    sys.exit(asyncio.run(run(config)))


class MeshProcess:
    """``kvmesh up`` as a child process, for tests and benchmarks: start it, wait for its banner,
    read where it listens, stop it with SIGTERM."""

    def __init__(self, *args: str, http_port: int | None = None, env: dict[str, str] | None = None) -> None:
        """``env``: variables set for it on top of this process's environment."""
        from kvmesh.common.ports import free_port

        self.http_port = http_port or free_port()
        self.env = env or {}
        self.argv = [sys.executable, "-m", "kvmesh", "up", "--http-port", str(self.http_port), *args]
        self.output: list[str] = []
        self.process: subprocess.Popen[str] | None = None
        self.nats_url = ""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def api(self) -> str:
        return f"{self.base_url}/v1"

    def start(self, timeout: float = 60.0) -> MeshProcess:
        import os
        import re
        import threading

        self.process = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"},
        )
        stdout = self.process.stdout
        threading.Thread(target=lambda: self.output.extend(iter(stdout.readline, "")), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not any("kvmesh is up" in line for line in self.output):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvmesh up did not start:\n" + "".join(self.output[-40:]))
            time.sleep(0.05)
        match = next(m for line in self.output if (m := re.search(r"NATS: (\S+)", line)))
        self.nats_url = match.group(1)
        return self

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM ``kvmesh up`` and return its exit code (it stops its children first)."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)
