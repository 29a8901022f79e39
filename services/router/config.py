"""Router configuration: one typed object, from flags and ``KVMESH_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ConfigError, GrpcEndpointConfig, option

ROUTER_MODES = ("kv", "round-robin", "random", "direct")


@dataclass
class RouterConfig(GrpcEndpointConfig):
    router_mode: str = option("kv", "how workers are chosen", choices=ROUTER_MODES)
    kv_cost: str = option(
        "ttft", "KV cost model: predicted time to first token, or Dynamo's block formula", choices=("ttft", "blocks")
    )
    kv_overlap_score_weight: float = option(1.0, "weight of prefill work in the KV cost (0: load only)")
    router_temperature: float = option(0.0, "softmax temperature over normalised costs (0: pick the minimum)")
    indexer_timeout_ms: float = option(500.0, "deadline of one overlap query to an indexer replica")
    seed: int | None = option(None, "seed for tie-breaking and sampling (default: random)")

    def validate(self) -> None:
        if self.kv_overlap_score_weight < 0:
            raise ConfigError("--kv-overlap-score-weight must be >= 0")
        if self.router_temperature < 0:
            raise ConfigError("--router-temperature must be >= 0")
