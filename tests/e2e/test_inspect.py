"""Operators look inside a running mesh: `kvmesh up --indexers 2`, `kvmesh inspect`, /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import openai
import pytest

from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.run_file import read_run_record
from kvmesh.devtools.mesh_process import MeshProcess
from kvmesh.inspector import inspect_routers
from tests.e2e.conftest import start_mesh
from tests.support import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_indexer_mesh() -> Iterator[MeshProcess]:
    yield from start_mesh("--indexers", "2")


def inspect_text(mesh: MeshProcess, what: str, *flags: str) -> str:
    """What `kvmesh inspect WHAT` prints for the mesh."""
    command = [sys.executable, "-m", "kvmesh", "inspect", what, "--nats-url", mesh.nats_url, *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout


def inspect(mesh: MeshProcess, what: str) -> list[dict]:
    return json.loads(inspect_text(mesh, what, "--json"))  # stdout holds nothing but the JSON


def test_inspect_shows_both_replicas_in_step_with_the_workers(two_indexer_mesh):
    client = openai.OpenAI(base_url=two_indexer_mesh.api, api_key="unused", max_retries=0)
    for i in range(6):
        client.completions.create(model="kvmesh-tiny", prompt=f"inspect me {i} " * 20, max_tokens=3)
    rows = inspect(two_indexer_mesh, "worker")
    workers = {w["worker_id"]: w["cached_blocks"] for w in rows}
    assert len(workers) == 2 and sum(workers.values()) > 0
    # the mock engines of one speed-up share a speed class, which the text shows too (decision 62)
    assert {w["speed_class"] for w in rows} == {"mock x50"}
    text = inspect_text(two_indexer_mesh, "worker")
    assert text.count("speed class: mock x50") == 2

    def replicas_caught_up() -> bool:
        rows = inspect(two_indexer_mesh, "indexer")
        return len(rows) == 2 and all(
            row["lag"] == 0
            and {w["worker_id"]: w["blocks"] for w in row["workers"] if w["blocks"]}
            == {k: v for k, v in workers.items() if v}
            for row in rows
        )

    wait_until(replicas_caught_up, timeout=20, what="both replicas report the workers' block counts")
    text = inspect_text(two_indexer_mesh, "indexer")
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


def test_inspect_finds_the_running_mesh_without_flags(two_indexer_mesh):
    """`kvmesh up` recorded its NATS URL in the run file: `kvmesh inspect worker` needs no --nats-url."""
    record = read_run_record("default")
    assert record is not None and record.nats_url == two_indexer_mesh.nats_url
    assert record.api == two_indexer_mesh.api
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh", "inspect", "worker", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "KVMESH_NATS_URL"},
    )
    assert len(json.loads(result.stdout)) == 2
    assert f"kvmesh up (pid {record.pid}" in result.stderr


def test_inspect_router_shows_mode_predicted_load_and_recent_outcomes(two_indexer_mesh):
    client = openai.OpenAI(base_url=two_indexer_mesh.api, api_key="unused", max_retries=0, timeout=60)
    (before,) = inspect(two_indexer_mesh, "router")
    # a long stream stays in flight while the router is asked: its worker carries predicted load
    stream = client.completions.create(model="kvmesh-tiny", prompt="hold on " * 40, max_tokens=4000, stream=True)
    next(iter(stream))
    (during,) = asyncio.run(inspect_routers(two_indexer_mesh.nats_url, "default", timeout=5))
    stream.close()
    assert during["mode"] == "kv" and during["metrics"] and during["address"]
    assert len(during["workers"]) == 2
    assert during["active_requests"] >= 1
    assert any(w["active_decode_blocks"] > 0 for w in during["workers"])

    for i in range(3):
        client.completions.create(model="kvmesh-tiny", prompt=f"outcome {i} " * 10, max_tokens=2)
    # the router counts an outcome just after its last message, which the client may see first:
    # wait for the counts. Earlier requests may leave the 60 s window meanwhile: the totals count.
    readings: list[dict] = []

    def counted() -> bool:
        readings[:] = inspect(two_indexer_mesh, "router")
        return readings[0]["total_outcomes"].get("completed", 0) >= before["total_outcomes"].get("completed", 0) + 3

    wait_until(counted, timeout=20, what="the three completions in the router's outcomes")
    (after,) = readings
    assert after["recent_outcomes"]["completed"] >= 3
    assert after["total_outcomes"]["completed"] >= after["recent_outcomes"]["completed"]

    text = inspect_text(two_indexer_mesh, "router")
    assert "mode kv" in text and "predicted" in text and "completed" in text


DASHBOARD = Path(__file__).resolve().parents[2] / "observability" / "grafana" / "dashboards" / "kvmesh.json"
_SAMPLE_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def _family(name: str) -> str:
    for suffix in _SAMPLE_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def charted_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert exprs, "the dashboard charts nothing"
    return {name for expr in exprs for name in re.findall(r"\bkvmesh_[a-z_]+", expr)}


def test_every_metric_the_grafana_dashboard_charts_exists_on_a_running_mesh(two_indexer_mesh):
    client = openai.OpenAI(base_url=two_indexer_mesh.api, api_key="unused", max_retries=0)
    client.completions.create(model="kvmesh-tiny", prompt="dashboard " * 20, max_tokens=3)
    endpoints = [two_indexer_mesh.api.removesuffix("/v1")]  # the frontend serves /metrics on its HTTP port
    for what in ("router", "worker", "indexer"):
        endpoints += [f"http://{row['metrics']}" for row in inspect(two_indexer_mesh, what)]
    exposed: set[str] = set()
    for endpoint in endpoints:
        text = httpx.get(f"{endpoint}/metrics", timeout=10).text
        # families with no sample yet (labelled counters never incremented) still have a TYPE line
        exposed |= {_family(n) for n in re.findall(r"^# TYPE (\S+)", text, re.MULTILINE)}
        exposed |= {_family(n) for n in re.findall(r"^(kvmesh_[a-z_]+)", text, re.MULTILINE)}
    missing = sorted(name for name in charted_metrics() if _family(name) not in exposed)
    assert not missing, f"the dashboard charts metrics no service exposes: {missing}"
