"""The worker's Prometheus metrics: request counters and the engine's state read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.common.core.timing import as_constants
from kvmesh.worker.cache_moves import CacheMoves
from kvmesh.worker.engine import Engine
from kvmesh.worker.event_publisher import KvEventPublisher
from kvmesh.worker.kv_transfer.transport import KvTransferServer, TransferStats


class _EngineCollector(Collector):
    def __init__(
        self,
        engine: Engine,
        publisher: KvEventPublisher,
        transfer: KvTransferServer | None,
        moves: CacheMoves | None = None,
    ) -> None:
        self._engine = engine
        self._publisher = publisher
        self._transfer = transfer
        self._moves = moves

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        status = self._engine.status()
        fitted = self._engine.fitted_timing()
        if fitted is not None:
            constants = GaugeMetricFamily(
                "kvmesh_worker_step_time_constant",
                "fitted step-time model (prefill ms = a·T²+b·T+c, decode ms = a·u²+b·u+c), as advertised to routers",
                labels=["constant"],
            )
            for name, value in as_constants(fitted).items():
                constants.add_metric([name], value)
            yield constants
        yield GaugeMetricFamily(
            "kvmesh_worker_cached_blocks", "blocks registered in the prefix cache", value=status.cached_blocks
        )
        yield GaugeMetricFamily(
            "kvmesh_worker_active_blocks", "blocks held by running sequences", value=status.active_blocks
        )
        yield GaugeMetricFamily("kvmesh_worker_total_blocks", "KV cache capacity in blocks", value=status.total_blocks)
        yield GaugeMetricFamily("kvmesh_worker_running_requests", "sequences running", value=status.running_requests)
        yield GaugeMetricFamily("kvmesh_worker_waiting_requests", "sequences waiting", value=status.waiting_requests)
        yield CounterMetricFamily(
            "kvmesh_worker_kv_events_published",
            "KV events published to JetStream",
            value=self._publisher.published_events,
        )
        pool_stats = getattr(self._engine, "pool_stats", None)
        pool_writer = getattr(self._engine, "pool_writer", None)
        if pool_writer is not None and pool_stats is not None:
            pool = CounterMetricFamily(
                "kvmesh_worker_kv_pool_blocks", "KV blocks moved through the host's KV pool", labels=["direction"]
            )
            pool.add_metric(["written"], pool_writer.written_blocks)
            pool.add_metric(["imported"], pool_stats.imported_blocks)
            pool.add_metric(["rejected"], pool_stats.rejected_blocks)
            yield pool
        if self._moves is not None:
            moves = CounterMetricFamily(
                "kvmesh_worker_cache_move_blocks",
                "cached blocks held for another worker to take (a join's warm-up, a shrink's hand-on), and taken "
                "from others",
                labels=["direction"],
            )
            moves.add_metric(["offered"], self._moves.offered_blocks)
            moves.add_metric(["taken"], self._moves.taken_blocks)
            yield moves
        if self._transfer is None:  # an aggregated vLLM worker moves no KV
            return
        backend = GaugeMetricFamily(
            "kvmesh_worker_kv_transfer_backend", "KV transfer backend in use", labels=["backend"]
        )
        backend.add_metric([self._transfer.backend], 1)
        yield backend
        moved = CounterMetricFamily(
            "kvmesh_worker_kv_transfer_bytes",
            "KV bytes moved to or from other workers",
            labels=["backend", "direction"],
        )
        stats = self._transfer.stats
        for name, table in (("sent", stats.bytes_sent), ("received", stats.bytes_received)):
            for key, value in table.items():
                moved.add_metric([key, name], value)
        yield moved
        pulls = CounterMetricFamily("kvmesh_worker_kv_pulls", "KV pulls made, by outcome", labels=["outcome"])
        for key, value in stats.pulls.items():
            pulls.add_metric([key], value)
        yield pulls
        seconds = CounterMetricFamily(
            "kvmesh_worker_kv_pull_seconds", "time the KV pulls this worker received took", labels=["backend"]
        )
        for key, value in stats.pull_seconds.items():
            seconds.add_metric([key], value)
        yield seconds
        yield GaugeMetricFamily(
            "kvmesh_worker_kv_transfers_in_flight", "KV pulls served or made right now", value=stats.in_flight
        )
        yield GaugeMetricFamily(
            "kvmesh_worker_held_prefills",
            "finished prefills holding KV for a decode worker",
            value=self._transfer.held_rooms(),
        )


@dataclass
class TransferView:
    """What the metrics read of a worker's KV transfer, whoever moves it (the worker's transfer
    server and client, or the engine's own connector)."""

    backend: str
    stats: TransferStats
    held_rooms: Callable[[], int] = lambda: 0

    @classmethod
    def of_server(cls, server: KvTransferServer) -> TransferView:
        return cls(server.backend, server.stats, server.held_rooms)


class WorkerMetrics:
    def __init__(
        self,
        engine: Engine,
        publisher: KvEventPublisher,
        transfer: TransferView | None,
        moves: CacheMoves | None = None,
    ) -> None:
        """``transfer``: what moved KV for this worker (None: nothing does); ``moves``: its cached
        blocks' moves (None: its engine makes none)."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvmesh_worker_requests", "requests by finish reason", ["finish_reason"], registry=self.registry
        )
        self.prompt_tokens = Counter("kvmesh_worker_prompt_tokens", "prompt tokens received", registry=self.registry)
        self.cached_tokens = Counter(
            "kvmesh_worker_cached_prompt_tokens", "prompt tokens served from the cache", registry=self.registry
        )
        self.generated_tokens = Counter("kvmesh_worker_generated_tokens", "tokens generated", registry=self.registry)
        self.registry.register(_EngineCollector(engine, publisher, transfer, moves))
