"""With no NATS at the URL, every service and tool fails within its connect timeout, with one line
that names the URL (they used to retry every 0.5 s forever)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support import free_port

pytestmark = pytest.mark.integration

COMMANDS = {
    "router": ["kvmesh.router"],
    "indexer": ["kvmesh.indexer"],
    "worker": ["kvmesh.worker"],
    "frontend": ["kvmesh.frontend", "--http-port", "0"],
    "inspect": ["kvmesh", "inspect", "worker"],
}


def run(argv: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )
    return result, time.monotonic() - started


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_service_or_tool_with_no_nats_fails_within_its_timeout_naming_the_url(name: str):
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    result, seconds = run([*COMMANDS[name], "--nats-url", url, "--nats-connect-timeout", "1"], {})
    assert result.returncode != 0
    assert f"cannot connect to NATS at {url}: within 1 s" in result.stderr
    assert seconds < 30  # start-up plus the one second, not forever


def test_the_default_timeout_comes_from_the_environment():
    url = f"nats://127.0.0.1:{free_port()}"
    result, _ = run(["kvmesh", "inspect", "router", "--nats-url", url], {"KVMESH_NATS_CONNECT_TIMEOUT": "0.5"})
    assert result.returncode != 0
    assert f"cannot connect to NATS at {url}: within 0.5 s" in result.stderr
