"""With ``--planner``: the planner process and the worker pools it resizes through ``kvmesh up``."""

from __future__ import annotations

from pathlib import Path

import structlog
from nats.aio.client import Client as NatsClient

from kvmesh.common.core.timing import TimingModel
from kvmesh.common.runtime.config import options_argv
from kvmesh.common.runtime.nats_auth import NatsCredentials
from kvmesh.common.runtime.process import connect_nats
from kvmesh.common.wire import names
from kvmesh.planner.options import PlannerOptions
from kvmesh.profiler.mock import profile_mock_engine
from kvmesh.up.config import UpConfig
from kvmesh.up.departures import departure_order
from kvmesh.up.processes import ServiceProcess, common_args, worker_process
from kvmesh.worker.engines.mock.mock_engine import EngineConfig
from kvmesh.worker_pool import WorkerPool, WorkerPools

log = structlog.get_logger(__name__)


def plan_planner(
    config: UpConfig, nats_url: str, services: list[ServiceProcess], workdir: Path
) -> tuple[ServiceProcess, WorkerPools]:
    """The planner process (with a profile of the workers' mock engine, measured now) and the pools
    it resizes through this supervisor: the aggregated workers, or the prefill and the decode ones.
    The profile, and the state file unless ``--planner-state-db`` names one, go in ``workdir``, which
    the caller removes when the mesh stops."""
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
        leaving = {}
        if config.shrink_handoff_blocks:
            # the workers whose departure loses least go first; each hands its hot blocks on
            for role in pool.shrinking(message.data):
                workers = pool.pools[role].workers
                leaving[role] = await departure_order(nc, namespace, workers, config.shrink_handoff_blocks)
        await message.respond(pool.answer(message.data, leaving))

    await nc.subscribe(names.planner_scale_subject(namespace), cb=on_request)
    return nc
