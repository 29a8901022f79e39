"""Indexer configuration: one typed object, from flags and ``KVMESH_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import CommonConfig, option


@dataclass
class IndexerConfig(CommonConfig):
    host: str = option("127.0.0.1", "address the gRPC server binds and advertises")
    port: int = option(0, "gRPC port (0 picks a free one)")
    replica_id: str = option("0", "stable replica name; its durable consumer is `indexer-<replica-id>`")
    router_reset_states: bool = option(False, "drop this replica's durable consumer and start clean")
    lease_ttl: float = option(6.0, "discovery lease in seconds")
