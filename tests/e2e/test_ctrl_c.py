"""Ctrl-C on `kvmesh up` (SIGINT to its whole process group, as a terminal sends it) stops the
services first and NATS last: no service logs a lost NATS connection while stopping, and nothing is
left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.support import free_port, wait_until

pytestmark = pytest.mark.e2e


def test_ctrl_c_stops_the_services_before_nats_quietly():
    mesh = subprocess.Popen(
        [sys.executable, "-m", "kvmesh", "up", "--http-port", str(free_port()), "--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "KVMESH_LOG_JSON": "false"},
        start_new_session=True,  # a process group of its own, like a shell job's: Ctrl-C goes to all of it
    )
    lines: list[str] = []
    assert mesh.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(mesh.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("kvmesh is up" in line for line in lines), timeout=60, what="the mesh up")
        os.killpg(mesh.pid, signal.SIGINT)
        assert mesh.wait(timeout=30) == 0
    finally:
        if mesh.poll() is None:
            os.killpg(mesh.pid, signal.SIGKILL)
            mesh.wait()
    reader.join(timeout=10)
    output = "".join(lines)
    assert "all services stopped" in output
    noise = [line for line in lines if "NATS disconnected" in line or "NATS error" in line]
    assert noise == [], "".join(noise)
