"""Indexer configuration: one typed object, from flags and ``KVMESH_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import GrpcEndpointConfig, option


@dataclass
class IndexerConfig(GrpcEndpointConfig):
    replica_id: str = option("0", "stable replica name; its durable consumer is `indexer-<replica-id>`")
    router_reset_states: bool = option(False, "drop this replica's durable consumer and start clean")
