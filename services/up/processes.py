"""The processes a mesh runs: one per service, each with the flags ``kvmesh up`` hands it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

from kvmesh.common.runtime.child_process import ending_with_parent
from kvmesh.common.runtime.config import (
    options_argv,
    secret_env,
)
from kvmesh.common.runtime.process import PARENT_PID_ENV
from kvmesh.frontend.config import HttpApiOptions
from kvmesh.indexer.config import SnapshotOptions
from kvmesh.router.config import RouterOptions
from kvmesh.up.config import UpConfig
from kvmesh.worker.config import EngineOptions
from kvmesh.worker.engines.vllm import vllm_defaults

log = structlog.get_logger(__name__)


class ServiceProcess:
    """One child service process."""

    def __init__(self, name: str, module: str, args: list[str], env: dict[str, str] | None = None) -> None:
        """``env``: added to the environment it inherits (secrets go there, not on its command line,
        which every user of the machine can read)."""
        self.name = name
        self.argv = [sys.executable, "-m", module, *args]
        # Every service watches that we live (see stop_when_orphaned): none outlives `kvmesh up`.
        self.env = {**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid())}
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

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

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
            [*common, "--replica-id", str(i), *options_argv(SnapshotOptions, config)],
        )
        for i in range(config.indexers)
    ]
    router_args = [*common, *options_argv(RouterOptions, config)]
    services += [ServiceProcess(f"router-{i}", "kvmesh.router", router_args) for i in range(config.routers)]
    role = "decode" if config.prefill_workers else "aggregated"
    engine_args = [*config.engine_args, *vllm_cpu_defaults(config)]
    if binding := vllm_cpu_threads(config, 0):
        log.info("vLLM's CPU build: set the engines' thread binding apart", first_engine=binding)
    services += [worker_process(config, common, i, role, engine_args) for i in range(config.workers)]
    services += [worker_process(config, common, i, "prefill", engine_args) for i in range(config.prefill_workers)]
    load_reports = ["--load-report-secs", str(min(5.0, config.adjustment_interval / 2))] if config.planner else []
    services.append(
        ServiceProcess(
            "frontend",
            "kvmesh.frontend",
            [*common, *options_argv(HttpApiOptions, config), *load_reports],
            env=secret_env(HttpApiOptions, config) or None,
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


AUTO_POOL = "auto"


def kv_pool_directory(config: UpConfig) -> Path:
    """This mesh's KV pool: the directory ``--kv-pool`` names, or for ``auto`` one of its own in
    /dev/shm (shared memory) where the host has it, removed when the mesh stops."""
    if config.kv_pool != AUTO_POOL:
        return Path(config.kv_pool)
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"kvmesh-pool-{config.namespace}-{os.getpid()}"


def engines_on_host(config: UpConfig) -> int:
    """The engines ``kvmesh up`` starts on this host: a data-parallel rank is an engine core of its own."""
    return (config.workers + config.prefill_workers) * config.data_parallel_size


def vllm_cpu_defaults(config: UpConfig) -> list[str]:
    """With ``--engine vllm`` on vLLM's CPU build: the engine arguments the user left out that make
    the engines start here (their KV caches share this host's memory), said once in the log."""
    if config.engine != "vllm" or not vllm_defaults.cpu_build():
        return []
    chosen = vllm_defaults.cpu_defaults(config.engine_args, engines_on_host(config), vllm_defaults.available_memory())
    if chosen:
        argv = vllm_defaults.as_argv(chosen)
        log.info(
            "vLLM's CPU build: chose for every worker what was not given",
            chose=vllm_defaults.describe(chosen),
            engine_args=" ".join(argv),
        )
        return argv
    return []


def worker_process(
    config: UpConfig, common: list[str], index: int, role: str, engine_args: list[str] | None = None
) -> ServiceProcess:
    """``engine_args``: what goes to the engine (default: the ones ``kvmesh up`` was given)."""
    worker_args = [
        *common,
        *options_argv(EngineOptions, config),
        "--model-name",
        config.model_name,
        *(["--kv-pool", str(kv_pool_directory(config))] if config.kv_pool else []),
        *(config.engine_args if engine_args is None else engine_args),
    ]
    name = f"worker-{index}" if role != "prefill" else f"prefill-worker-{index}"
    return ServiceProcess(name, "kvmesh.worker", [*worker_args, "--role", role], vllm_cpu_threads(config, index))


def vllm_cpu_threads(config: UpConfig, slot: int) -> dict[str, str]:
    """With ``--engine vllm`` on vLLM's CPU build: the environment that gives the worker in ``slot``
    cores of its own among this host's engines (see :func:`vllm_defaults.cpu_threads`). Not with
    prefill workers: engines with vLLM's NIXL connector keep vLLM's own binding, since undoing it made
    every KV pull time out (docs/perf, Disaggregation)."""
    if config.engine != "vllm" or config.prefill_workers or not vllm_defaults.cpu_build():
        return {}
    cores = sorted(os.sched_getaffinity(0))
    return vllm_defaults.cpu_threads(slot, engines_on_host(config), cores, config.data_parallel_size)
