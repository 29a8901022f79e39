"""Indexer configuration: one typed object, from flags and ``KVMESH_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common.runtime.config import GrpcEndpointConfig, option


@dataclass
class SnapshotOptions:
    """Indexer snapshots: when a replica snapshots the index.

    Declared once: ``kvmesh indexer`` and ``kvmesh up`` take it."""

    router_snapshot_threshold: int = option(
        1_000_000,
        "take a snapshot and purge once the event stream holds more of this namespace's messages than this",
    )


@dataclass
class IndexerConfig(GrpcEndpointConfig, SnapshotOptions):
    kv_events_max_age: float = option(
        3600.0, "seconds the KV event stream keeps a message, if this process creates the stream"
    )
    replica_id: str = option("0", "stable replica name; its durable consumer is `indexer-<namespace>-<replica-id>`")
    durable_inactive_threshold: float = option(
        3600.0,
        "seconds NATS keeps this replica's durable consumer while no replica reads it (one scaled away "
        "must not hold back the stream's purge)",
    )
    router_reset_states: bool = option(False, "start clean: ignore the snapshot, drop this replica's durable consumer")
    snapshot_check_interval: float = option(5.0, "seconds between checks of the stream size")
