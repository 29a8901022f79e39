"""`kvmesh up` whose plan fails after its embedded NATS has started (here a `--kv-pool` directory
that cannot be made) says so in one log line and leaves nothing behind: no NATS server, no store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import free_port, wait_until

pytestmark = pytest.mark.e2e


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_plan_that_fails_after_nats_started_stops_nats_and_removes_its_store(tmp_path):
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    pool = not_a_directory / "pool"
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh", "up", "--http-port", str(free_port()), "--kv-pool", str(pool)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "KVMESH_LOG_JSON": "true"},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    started = next(event for event in events if event["event"] == "embedded NATS started")
    failed = next(event for event in events if event["event"] == "start-up failed")
    assert str(pool) in failed["error"]
    assert not Path(started["store"]).exists()
    for pid in started["pids"]:
        wait_until(lambda pid=pid: not _running(pid), timeout=10, what=f"NATS server {pid} gone")
