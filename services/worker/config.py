"""Worker configuration: one typed object, from flags and ``KVMESH_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ConfigError, GrpcEndpointConfig, option

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

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ConfigError("--block-size must be positive")
        if self.num_gpu_blocks <= 0:
            raise ConfigError("--num-gpu-blocks-override must be positive")
        if self.speedup_ratio <= 0:
            raise ConfigError("--speedup-ratio must be positive")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ConfigError("--max-num-seqs and --max-num-batched-tokens must be positive")
