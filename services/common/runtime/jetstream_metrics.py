"""Prometheus view of how the JetStream state kvmesh keeps is replicated (every indexer replica
exports it: the indexers are the services that depend most on the KV event stream)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import structlog
from nats.js import JetStreamContext
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.common.runtime.jetstream_state import StreamState, kvmesh_streams

log = structlog.get_logger(__name__)


class JetStreamCollector(Collector):
    """Exports the last states :meth:`poll_forever` read: a scrape never waits on NATS."""

    def __init__(self) -> None:
        self.states: list[StreamState] = []

    async def poll_forever(self, js: JetStreamContext, interval_s: float = 5.0) -> None:
        while True:
            try:
                self.states = await kvmesh_streams(js)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a NATS outage shows as stale figures, not as a dead loop
                log.warning("reading JetStream stream states failed", error=str(exc))
            await asyncio.sleep(interval_s)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = GaugeMetricFamily(
            "kvmesh_jetstream_replicas", "replicas a kvmesh stream is configured with", labels=["stream"]
        )
        current = GaugeMetricFamily(
            "kvmesh_jetstream_current_replicas",
            "replicas that hold the stream now (leader and current followers)",
            labels=["stream"],
        )
        leader = GaugeMetricFamily(
            "kvmesh_jetstream_leader", "1 for the server that leads the stream", labels=["stream", "server"]
        )
        lag = GaugeMetricFamily(
            "kvmesh_jetstream_follower_lag",
            "operations a follower is behind the stream's leader",
            labels=["stream", "server"],
        )
        messages = GaugeMetricFamily("kvmesh_jetstream_messages", "messages the stream holds", labels=["stream"])
        for state in self.states:
            replicas.add_metric([state.stream], state.replicas)
            current.add_metric([state.stream], state.current_replicas)
            messages.add_metric([state.stream], state.messages)
            if state.leader:
                leader.add_metric([state.stream, state.leader], 1)
            for peer in state.peers:
                lag.add_metric([state.stream, peer.name], peer.lag)
        yield from (replicas, current, leader, lag, messages)
