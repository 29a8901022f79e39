"""The indexer's Prometheus metrics, read from the index's own counters at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.common.core.prefix_index import PrefixIndex


class IndexerState:
    """Figures the service shell updates (the index keeps its own counters)."""

    def __init__(self) -> None:
        self.applied_sequence = 0
        self.stream_last_sequence = 0
        self.namespace_messages = 0  # this namespace's events in the stream, at the last check
        self.lag_messages = 0  # of those, how many the replica's durable has yet to deliver
        self.snapshot_sequence = 0
        self.snapshots_taken = 0
        self.last_snapshot_seconds = 0.0
        self.last_snapshot_bytes = 0
        self.last_purged_below = 0
        self.malformed_messages = 0


class IndexerCollector(Collector):
    def __init__(self, index: PrefixIndex, state: IndexerState) -> None:
        self._index = index
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._index.stats
        for name, help_text, value in (
            ("events_applied", "KV events applied to the index", stats.events_applied),
            ("blocks_stored", "blocks stored by applied events", stats.blocks_stored),
            ("blocks_removed", "blocks removed by applied events", stats.blocks_removed),
            ("duplicate_events", "events skipped as already applied", stats.duplicates_skipped),
            ("unknown_parent", "stored events whose parent block was unknown", stats.unknown_parent),
            ("gaps", "gaps detected in a worker's event ids", stats.gaps),
            ("recoveries", "workers rebuilt from their own dump", stats.recoveries),
            ("snapshots", "snapshots uploaded by this replica", self._state.snapshots_taken),
            ("malformed_messages", "stream messages skipped as malformed", self._state.malformed_messages),
        ):
            yield CounterMetricFamily(f"kvmesh_indexer_{name}", help_text, value=value)
        state = self._state
        yield GaugeMetricFamily(
            "kvmesh_indexer_applied_sequence", "last stream sequence applied", value=state.applied_sequence
        )
        yield GaugeMetricFamily(
            "kvmesh_indexer_lag",
            "this namespace's events in the stream not yet applied (the durable's pending count)",
            value=state.lag_messages,
        )
        yield GaugeMetricFamily(
            "kvmesh_indexer_snapshot_duration_seconds",
            "duration of the last snapshot",
            value=state.last_snapshot_seconds,
        )
        yield GaugeMetricFamily(
            "kvmesh_indexer_snapshot_bytes", "size of the last snapshot", value=state.last_snapshot_bytes
        )
        yield GaugeMetricFamily(
            "kvmesh_indexer_recovering_workers", "workers waiting for their dump", value=len(self._index.recovering)
        )
        blocks = GaugeMetricFamily(
            "kvmesh_indexer_worker_blocks", "blocks indexed per worker", labels=["worker_id", "dp_rank"]
        )
        for (worker_id, dp_rank), size in self._index.tree_sizes().items():
            blocks.add_metric([str(worker_id), str(dp_rank)], size)
        yield blocks


def build_registry(index: PrefixIndex, state: IndexerState) -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    registry.register(IndexerCollector(index, state))
    query_latency = Histogram(
        "kvmesh_indexer_query_seconds",
        "FindMatches latency inside the indexer",
        buckets=(5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 1e-2),
        registry=registry,
    )
    return registry, query_latency
