"""The failure drills on test hosts under streaming load, each twice (kvmesh.devtools.drills; the
figures: `python -m bench.drills`): kill -9 of a whole host (NATS node included), a host's link cut
for 20 s, kill -9 of the NATS node leading the KV event stream, a rolling restart of every NATS node.
Each run: no request fails through a frontend that stayed up, none outruns its deadline, every
indexer replica ends up holding exactly what the workers hold, discovery drops a lost host's
instances and takes them back, and a new indexer replica restores from the snapshot."""

from __future__ import annotations

import pytest

from kvmesh.devtools.drills import DRILLS, run_drill
from kvmesh.devtools.host_mesh import HostMesh
from tests.hosts.conftest import CLIENT

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LOG_LINES = 60
RUNS = 2


# Each run's own waits are bounded (discovery 90 s, recovery 120 s): a run that does not recover
# reports why (its report, the services' warnings) before pytest's default 180 s would cut it short.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("drill", DRILLS)
def test_drill(host_mesh: HostMesh, drill: str):
    # the first run strikes the host without a frontend, the second one with a frontend
    targets = ["h3", "h2"]
    for run, target in enumerate(targets[:RUNS], start=1):
        report = host_mesh.hosts.in_namespace(CLIENT, lambda r=run, t=target: run_drill(host_mesh, drill, r, t))
        print(report.as_dict())
        if not report.ok():
            print(warnings_of(host_mesh, "frontend", "indexer", "router"))
        assert report.requests > 100, report
        assert report.failed == 0 and report.hung == 0, report.errors
        assert report.converged, report.errors
        assert report.snapshot_restore, report.errors
        if drill in ("kill-host", "partition"):
            assert report.discovery_drop_s is not None and report.discovery_return_s is not None, report


def warnings_of(mesh: HostMesh, *services: str) -> str:
    """The last warnings of each service on each host (the logs die with the hosts), to tell what
    happened when a run fails."""
    lines = []
    for host in mesh.layout.mesh_hosts:
        for service in services:
            path = mesh.log(host, service)
            if not path.exists():
                continue
            found = [line for line in path.read_text(errors="replace").splitlines() if '"warning"' in line]
            lines += [f"{host}-{service}: {line[:400]}" for line in found[-LOG_LINES:]]
    return "\n".join(lines)
