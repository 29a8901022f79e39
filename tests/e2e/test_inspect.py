"""Operators look inside a running mesh: `kvmesh up --indexers 2`, `kvmesh inspect`, /metrics."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import nats
import openai
import pytest

from kvmesh.common.discovery import DiscoveryWatcher
from kvmesh.up import MeshProcess
from tests.e2e.conftest import start_mesh
from tests.support import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_indexer_mesh() -> Iterator[MeshProcess]:
    yield from start_mesh("--indexers", "2")


def inspect(mesh: MeshProcess, what: str) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh", "inspect", what, "--nats-url", mesh.nats_url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(result.stdout)  # stdout holds nothing but the JSON


def test_inspect_shows_both_replicas_in_step_with_the_workers(two_indexer_mesh):
    client = openai.OpenAI(base_url=two_indexer_mesh.api, api_key="unused", max_retries=0)
    for i in range(6):
        client.completions.create(model="kvmesh-tiny", prompt=f"inspect me {i} " * 20, max_tokens=3)
    workers = {w["worker_id"]: w["cached_blocks"] for w in inspect(two_indexer_mesh, "worker")}
    assert len(workers) == 2 and sum(workers.values()) > 0

    def replicas_caught_up() -> bool:
        rows = inspect(two_indexer_mesh, "indexer")
        return len(rows) == 2 and all(
            row["lag"] == 0
            and {w["worker_id"]: w["blocks"] for w in row["workers"] if w["blocks"]}
            == {k: v for k, v in workers.items() if v}
            for row in rows
        )

    wait_until(replicas_caught_up, timeout=20, what="both replicas report the workers' block counts")
    text = subprocess.run(
        [sys.executable, "-m", "kvmesh", "inspect", "indexer", "--nats-url", two_indexer_mesh.nats_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "replica 0" in text and "replica 1" in text and "lag 0" in text

    metrics = inspect(two_indexer_mesh, "indexer")[0]["metrics"]
    scraped = httpx.get(f"http://{metrics}/metrics", timeout=10).text
    for name in (
        "kvmesh_indexer_events_applied_total",
        "kvmesh_indexer_lag",
        "kvmesh_indexer_worker_blocks",
        "kvmesh_indexer_query_seconds_bucket",
        "kvmesh_indexer_gaps_total",
    ):
        assert name in scraped, name


def test_every_grpc_service_serves_prometheus_metrics(two_indexer_mesh):
    client = openai.OpenAI(base_url=two_indexer_mesh.api, api_key="unused", max_retries=0)
    client.completions.create(model="kvmesh-tiny", prompt="metrics please " * 10, max_tokens=4)
    worker = inspect(two_indexer_mesh, "worker")[0]
    scraped = httpx.get(f"http://{worker['metrics']}/metrics", timeout=10).text
    for name in ("kvmesh_worker_cached_blocks", "kvmesh_worker_requests_total", "kvmesh_worker_kv_events_published"):
        assert name in scraped, name

    async def router_metrics_address() -> str:
        nc = await nats.connect(two_indexer_mesh.nats_url)
        watcher = DiscoveryWatcher(nc.jetstream(), "default", "router")
        await watcher.start()
        address = watcher.instances()[0].extra["metrics"]
        await watcher.stop()
        await nc.close()
        return address

    scraped = httpx.get(f"http://{asyncio.run(router_metrics_address())}/metrics", timeout=10).text
    assert 'kvmesh_router_requests_total{outcome="completed"}' in scraped
    for name in (
        "kvmesh_router_decision_seconds_bucket",
        "kvmesh_router_active_decode_blocks",
        "kvmesh_router_migrations_total",
    ):
        assert name in scraped, name
