"""``kvmesh up``'s configuration: its own options and the option groups it hands its services."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmesh.common.runtime.config import CommonConfig, ConfigError, option
from kvmesh.frontend.config import HttpApiOptions
from kvmesh.indexer.config import SnapshotOptions
from kvmesh.planner.options import PlannerOptions
from kvmesh.router.config import RouterOptions
from kvmesh.worker.config import EngineOptions, check_data_parallel, check_host_tier, check_lora_adapters
from kvmesh.worker.engines.vllm.vllm_defaults import check_block_size


@dataclass
class UpConfig(CommonConfig, RouterOptions, PlannerOptions, EngineOptions, HttpApiOptions, SnapshotOptions):
    """``kvmesh up``'s own options, and the services' option groups, each declared once by its service
    and handed on unchanged: ``RouterOptions`` to the router replicas, ``EngineOptions`` to every
    worker, ``HttpApiOptions`` to the frontend, ``SnapshotOptions`` to the indexers, and with
    ``--planner`` the ``PlannerOptions`` to the planner."""

    nats_url: str | None = option(
        None, "use this NATS server (or cluster: several URLs, comma-separated) instead of starting an embedded one"
    )
    nats_cluster: int = option(
        1,
        "NATS servers to start when no --nats-url is given: 1, or 3 or more for an embedded cluster on loopback with "
        "every stream and bucket replicated three times (it survives the loss of one server; a dead one is restarted)",
    )
    workers: int = option(2, "number of workers (decode workers when --prefill-workers is set)")
    prefill_workers: int = option(
        0, "number of prefill-role mock workers; with any, the other workers run as decode workers (disaggregation)"
    )
    kv_pool: str = option(
        "",
        "mock workers share a host KV pool in this directory (as kvmesh worker --kv-pool; auto: a new one in "
        "/dev/shm, removed when the mesh stops): each writes the blocks it computes there and imports the blocks "
        "it lacks, so a request that moves to another worker resumes without recomputing its prompt",
    )
    indexers: int = option(1, "number of indexer replicas")
    routers: int = option(1, "number of router replicas behind the frontend")
    grpc_tls_cert: str | None = option(
        None, "certificate every gRPC server of the mesh presents (TLS on its request path)"
    )
    grpc_tls_key: str | None = option(None, "its private key")
    startup_timeout: float | None = option(
        None, "seconds to wait for every service to come up (default: 60, or 600 with --engine vllm)"
    )
    planner: bool = option(
        False,
        "run the SLA planner: it resizes the worker pool (from --workers, within --min-workers / --max-workers) "
        "to meet --ttft-target-ms and --itl-target-ms; with --prefill-workers, the prefill and decode pools apart",
    )
    planner_state_db: Path | None = option(
        None, "the planner's SQLite state file (default: a new one in a temp dir, removed when kvmesh up stops)"
    )
    engine_args: list[str] = option(None, "with --engine vllm: vLLM engine arguments for the workers", passthrough=True)

    def resolved_startup_timeout(self) -> float:
        # a vLLM worker loads (or first builds) its model and profiles its memory before it registers
        if self.startup_timeout is not None:
            return self.startup_timeout
        return 600.0 if self.engine == "vllm" else 60.0

    def validate(self) -> None:
        check_host_tier(self)
        check_lora_adapters(self)
        check_data_parallel(self, "prefill" if self.prefill_workers else "aggregated")
        RouterOptions.validate(self)
        if self.engine == "mock" and self.engine_args:
            unknown = " ".join(self.engine_args)
            raise ConfigError(f"unrecognized arguments: {unknown} (engine arguments need --engine vllm)")
        if self.workers < 1:
            raise ConfigError("--workers must be at least 1")
        if self.nats_cluster < 1 or self.nats_cluster == 2 or self.nats_cluster > 7:
            raise ConfigError(
                "--nats-cluster must be 1 (one server) or 3 to 7: JetStream needs a majority of servers up, so a "
                "cluster of 2 survives no loss"
            )
        if self.nats_cluster > 1 and self.nats_url is not None:
            raise ConfigError("--nats-cluster starts NATS servers; --nats-url uses servers already running: pick one")
        if self.indexers < 1:
            raise ConfigError("--indexers must be at least 1")
        if self.routers < 1:
            raise ConfigError("--routers must be at least 1")
        if self.prefill_workers < 0:
            raise ConfigError("--prefill-workers must be >= 0")
        if self.kv_pool and self.engine != "mock":
            raise ConfigError("--kv-pool is for mock workers (vLLM manages its own KV memory)")
        if self.engine == "served":
            raise ConfigError(
                "kvmesh up starts its own engines; to front an engine server already running, run "
                "kvmesh worker --engine served --engine-url URL beside the mesh"
            )
        if self.engine == "vllm":
            check_block_size(self.block_size)
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
