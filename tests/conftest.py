"""Fixtures: a real NATS server per test: the embedded binary, or with ``KVMESH_TEST_NATS=container``
a testcontainers container (see tests/containers/docker_engine.py for which image and network)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.runtime.nats_cluster import EmbeddedNatsCluster
from kvmesh.common.runtime.nats_server import EmbeddedNatsServer
from kvmesh.common.runtime.ports import free_port
from tests import leaks

# The tiers a skip hides most easily (a missing tool, no root, no engine, no trace). With
# KVMESH_SKIPS_FAIL=1 (CI's phases after the README's own) a skipped test of one fails the run.
REQUIRED_TIERS = {
    "tests/integration/test_k8s_manifests.py": "Kubernetes manifests",
    "tests/hosts/": "host drills",
    "tests/containers/": "containers",
    "tests/replay/": "replay",
    "tests/vllm/": "vLLM",
    "tests/bench/": "benchmark smoke",
}
_required_skips: list[tuple[str, str]] = []
_leaked_in_workers: list[str] = []  # pytest-xdist: what the workers' leak checks found


def pytest_configure(config: pytest.Config) -> None:
    # `kvmesh up` records itself for the other tools in a per-user run folder: the meshes the tests
    # start (and the tools they run) use a folder of their own, never the developer's running mesh.
    os.environ["KVMESH_RUN_DIR"] = tempfile.mkdtemp(prefix="kvmesh-test-run-")
    marker = leaks.mark_session()
    # Under pytest-xdist each worker inherits the controller's marker: a marker of its own keeps one
    # worker's leak check from finding (and killing) the processes of a test another is running.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:
        os.environ[leaks.MARKER] = f"{marker}-{worker}"


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ.get("KVMESH_RUN_DIR", ""), ignore_errors=True)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and os.environ.get("KVMESH_SKIPS_FAIL") == "1":
        tier = next((name for path, name in REQUIRED_TIERS.items() if report.nodeid.startswith(path)), None)
        if tier is not None:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            _required_skips.append((report.nodeid, f"{tier}: {reason}"))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """(pytest-xdist, in the controller) A worker is done: keep what its leak check found."""
    _leaked_in_workers.extend(getattr(node, "workeroutput", {}).get("kvmesh_leaked", []))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a test left a process running (and kill it: a leaked process holds CPU, and
    the CI log's pipe open so that CI never ends), or if a test of a required tier skipped. Under
    pytest-xdist each worker checks the processes its own tests started and the controller reports
    what they found."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if _required_skips:
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_sep("=", f"{len(_required_skips)} required test(s) skipped (KVMESH_SKIPS_FAIL)", red=True)
            for nodeid, why in _required_skips:
                reporter.write_line(f"  {nodeid}: {why}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if session.config.pluginmanager.hasplugin("dsession"):
        leaked = _leaked_in_workers
    else:
        found = leaks.leaked_processes(os.environ[leaks.MARKER])
        leaks.kill(found)
        leaked = [f"pid {process.pid}: {process.command}" for process in found]
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: its controller reports them
            workeroutput["kvmesh_leaked"] = leaked
    if not leaked:
        return
    if reporter is not None:
        reporter.write_sep("=", f"{len(leaked)} process(es) left running by the tests (killed)", red=True)
        for line in leaked:
            reporter.write_line(f"  {line}")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _container_nats() -> Iterator[str]:
    from tests.containers.docker_engine import nats_container, nats_url_of, require_engine

    require_engine()
    container, planned_url = nats_container(free_port())
    with container:
        yield nats_url_of(container, planned_url)


@pytest.fixture
async def nats_url() -> AsyncIterator[str]:
    if os.environ.get("KVMESH_TEST_NATS") == "container":
        gen = _container_nats()
        url = next(gen)
        try:
            yield url
        finally:
            next(gen, None)
        return
    server = await EmbeddedNatsServer().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
async def nats_cluster() -> AsyncIterator[EmbeddedNatsCluster]:
    """A three-node NATS cluster with JetStream on loopback (its ``url`` lists every node)."""
    cluster = await EmbeddedNatsCluster(3).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    client = await nats.connect(nats_url)
    try:
        yield client
    finally:
        await client.close()
