"""The router's Prometheus metrics: counters it keeps, and the load picture read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.common.runtime.misconfiguration import Findings
from kvmesh.router.active_sequences import ActiveSequences
from kvmesh.router.outcomes import OutcomeWindow
from kvmesh.router.request_queue import QueueListener


class _LoadCollector(Collector):
    def __init__(self, pictures: Callable[[], Iterable[ActiveSequences]], peers: Callable[[], int]) -> None:
        self._pictures = pictures
        self._peers = peers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        prefill = GaugeMetricFamily(
            "kvmesh_router_active_prefill_tokens",
            "predicted prefill tokens per worker",
            labels=["worker_id", "dp_rank"],
        )
        blocks = GaugeMetricFamily(
            "kvmesh_router_active_decode_blocks", "predicted active blocks per worker", labels=["worker_id", "dp_rank"]
        )
        requests = 0
        for picture in self._pictures():
            requests += len(picture)
            for worker in picture.workers():
                tokens, decode = picture.load(worker)
                prefill.add_metric([str(worker[0]), str(worker[1])], tokens)
                blocks.add_metric([str(worker[0]), str(worker[1])], decode)
        yield prefill
        yield blocks
        yield GaugeMetricFamily(
            "kvmesh_router_active_requests", "requests in the load picture (all replicas)", value=requests
        )
        yield GaugeMetricFamily("kvmesh_router_sync_peers", "other router replicas heard from", value=self._peers())


class RouterMetrics:
    """The router's Prometheus registry, and its request outcomes kept for ``GetStatus`` as well."""

    def __init__(self, pictures: Callable[[], Iterable[ActiveSequences]], peers: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.outcomes = OutcomeWindow()
        self.migrations_total = 0
        self.requests = Counter("kvmesh_router_requests", "requests by outcome", ["outcome"], registry=self.registry)
        self.migrations = Counter(
            "kvmesh_router_migrations", "requests moved off a failed worker", registry=self.registry
        )
        self.decision_seconds = Histogram(
            "kvmesh_router_decision_seconds",
            "time to choose a worker (including the indexer query)",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5),
            registry=self.registry,
        )
        self.prefills = Counter(
            "kvmesh_router_prefills",
            "prefills of requests while prefill workers are registered: remote (on a prefill worker) or local "
            "(on the decode worker), with the reason for local ones",
            ["where", "reason"],
            registry=self.registry,
        )
        self.kv_transfer_bytes = Counter(
            "kvmesh_router_kv_transfer_bytes",
            "KV bytes decode workers received from prefill workers, by transfer backend",
            ["backend"],
            registry=self.registry,
        )
        self.forwards = Counter(
            "kvmesh_router_forwards",
            "requests sent on to their worker for a frontend (sent), and forwards that failed: refused by the "
            "worker (the frontend submitted it itself) or lost (it moved on); docs/decisions/0030",
            ["result"],
            registry=self.registry,
        )
        self.forwards_sent = self.forwards.labels("sent")  # once per request: the child looked up once
        self.steered = Counter(
            "kvmesh_router_steered",
            "requests sent away from the worker their cost rated cheapest because it was late: stalled (its prefill "
            "queue showed no progress; docs/decisions/0063) or decodes behind (a session's first turn, while its "
            "decodes missed --kv-itl-target-ms; docs/decisions/0067)",
            ["rule"],
            registry=self.registry,
        )
        self.prefix_pulls = Counter(
            "kvmesh_router_prefix_pulls",
            "requests told to pull their prompt's cached prefix from a saturated holder over the KV transfer "
            "instead of computing it (--kv-pull-ratio; docs/decisions/0070)",
            registry=self.registry,
        )
        self.queue = QueueMetrics(self.registry)
        self.findings = Findings(self.registry)  # misconfigurations (kvmesh.router.fleet_checks)
        self.registry.register(_LoadCollector(pictures, peers))

    def migrated(self) -> None:
        """A request moved off a failed worker."""
        self.migrations.inc()
        self.migrations_total += 1

    def outcome(self, outcome: str) -> None:
        """A request ended this way (``completed``, or the gRPC status it was refused with)."""
        self.requests.labels(outcome).inc()
        self.outcomes.record(outcome)

    def forward_failed(self, lost: bool) -> None:
        self.forwards.labels("lost" if lost else "refused").inc()


class QueueMetrics(QueueListener):
    """The router queue's depth, wait and refusals per priority class."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._depth = Gauge(
            "kvmesh_router_queue_depth",
            "requests waiting for a worker to have capacity",
            ["priority"],
            registry=registry,
        )
        self._wait = Histogram(
            "kvmesh_router_queue_wait_seconds",
            "time requests spent in the router queue, by how they left it (admitted, timeout, cancelled)",
            ["priority", "outcome"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=registry,
        )
        self._refused = Counter(
            "kvmesh_router_queue_refusals",
            "requests refused for overload: full (the class's queue was full), timeout (its deadline passed while it "
            "waited), busy (every worker busy with the queue off)",
            ["priority", "reason"],
            registry=registry,
        )

    def depth(self, priority: str, depth: int) -> None:
        self._depth.labels(priority).set(depth)

    def waited(self, priority: str, seconds: float, outcome: str) -> None:
        self._wait.labels(priority, outcome).observe(seconds)

    def refused(self, priority: str, reason: str) -> None:
        self._refused.labels(priority, reason).inc()
