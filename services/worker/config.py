"""Worker configuration: one typed object, from flags and ``KVMESH_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common.config import ConfigError, GrpcEndpointConfig, option

DEFAULT_MODEL_NAME = "kvmesh-tiny"


@dataclass
class WorkerConfig(GrpcEndpointConfig):
    kv_events_max_age: float = option(
        3600.0, "seconds the KV event stream keeps a message, if this process creates the stream"
    )
    engine: str = option("mock", "inference engine", choices=("mock",))
    role: str = option(
        "aggregated",
        "worker role, part of its registration; routers never send whole requests to prefill workers",
        choices=("aggregated", "prefill", "decode"),
    )
    model_name: str = option(DEFAULT_MODEL_NAME, "model name served (what clients put in `model`)")
    block_size: int = option(16, "tokens per KV block")
    num_gpu_blocks: int = option(16384, "KV blocks in the cache (capacity)", flag="--num-gpu-blocks-override")
    max_num_seqs: int = option(256, "most sequences running at once")
    max_num_batched_tokens: int = option(8192, "token budget of one engine step (chunked prefill)")
    speedup_ratio: float = option(1.0, "divide simulated step times by this (>1 runs faster than real)")
    num_layers: int = option(2, "model shape for the KV buffer: layers")
    num_kv_heads: int = option(2, "model shape for the KV buffer: KV heads")
    head_dim: int = option(32, "model shape for the KV buffer: head dimension")
    kv_dtype_bytes: int = option(2, "model shape for the KV buffer: bytes per element")
    kv_transfer_backend: str = option(
        "auto",
        "how KV moves between prefill and decode workers: NIXL (UCX, DRAM; needs the nixl extra), "
        "built-in TCP, or auto (NIXL when installed, for prefill and decode roles)",
        choices=("auto", "nixl", "tcp"),
    )
    kv_transfer_port: int = option(0, "port of the KV transfer server (0: a free port, advertised in discovery)")
    kv_transfer_timeout_secs: float = option(
        30.0, "decode side: longest wait for a prefill's KV (rendezvous plus transfer) before prefilling locally"
    )
    disagg_hold_timeout_secs: float = option(
        30.0, "prefill side: release a finished prefill's KV if no decode worker has taken it by then"
    )

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ConfigError("--block-size must be positive")
        if self.num_gpu_blocks <= 0:
            raise ConfigError("--num-gpu-blocks-override must be positive")
        if self.speedup_ratio <= 0:
            raise ConfigError("--speedup-ratio must be positive")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ConfigError("--max-num-seqs and --max-num-batched-tokens must be positive")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype_bytes) <= 0:
            raise ConfigError("--num-layers, --num-kv-heads, --head-dim and --kv-dtype-bytes must be positive")
        if self.kv_transfer_timeout_secs <= 0 or self.disagg_hold_timeout_secs <= 0:
            raise ConfigError("--kv-transfer-timeout-secs and --disagg-hold-timeout-secs must be positive")

    def resolved_transfer_backend(self) -> str:
        """The backend this worker uses. Aggregated workers never serve a prefill for another worker,
        so ``auto`` spares them NIXL's start-up; they can still receive KV over TCP."""
        from kvmesh.worker.nixl_agent import nixl_available

        if self.kv_transfer_backend == "nixl":
            if not nixl_available():
                raise ConfigError(
                    "--kv-transfer-backend nixl needs the nixl extra: pip install torch==2.13.0 && "
                    'pip install -e ".[nixl]"'
                )
            return "nixl"
        if self.kv_transfer_backend == "auto" and self.role != "aggregated" and nixl_available():
            return "nixl"
        return "tcp"
