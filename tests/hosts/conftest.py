"""Test hosts (network namespaces) for the tests in this folder; skipped where they cannot be made."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.devtools.host_mesh import HostMesh, HostMeshLayout
from kvmesh.devtools.test_hosts import TestHosts, usable

CLIENT = "client"


def require_hosts() -> None:
    why_not = usable()
    if why_not:
        pytest.skip(why_not)


@pytest.fixture
def host_mesh(tmp_path: Path) -> Iterator[HostMesh]:
    """Three mesh hosts (NATS node, indexer, router, two mock workers each; a frontend on two of
    them) and a client host, all removed afterwards."""
    require_hosts()
    layout = HostMeshLayout()
    with TestHosts([*layout.mesh_hosts, CLIENT]) as hosts:
        mesh = HostMesh(hosts, tmp_path, layout)
        mesh.start()
        hosts.in_namespace(CLIENT, lambda: mesh.wait_ready(timeout=120))
        yield mesh
