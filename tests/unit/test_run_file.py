"""The run file through which `kvmesh up` tells the other tools where its mesh is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmesh.common.runtime.run_file import (
    DEFAULT_NATS_URL,
    RunRecord,
    read_run_record,
    remove_run_record,
    resolve_nats_url,
    run_file,
    write_run_record,
)


@pytest.fixture(autouse=True)
def own_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("KVMESH_NATS_URL", raising=False)
    monkeypatch.delenv("KVMESH_NAMESPACE", raising=False)


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_recorded_mesh_is_found_per_namespace():
    record = RunRecord("nats://127.0.0.1:4999", "team-a", "http://127.0.0.1:8123/v1", os.getpid())
    write_run_record(record)
    assert read_run_record("team-a") == record
    assert read_run_record("default") is None
    assert resolve_nats_url(None, "team-a")[0] == "nats://127.0.0.1:4999"
    assert resolve_nats_url(None, "default") == (DEFAULT_NATS_URL, "default")


def test_a_dead_meshs_record_is_ignored():
    write_run_record(RunRecord("nats://127.0.0.1:4999", "default", "http://x/v1", dead_pid()))
    assert read_run_record("default") is None
    assert resolve_nats_url(None) == (DEFAULT_NATS_URL, "default")


def test_the_flag_and_the_environment_come_before_the_record(monkeypatch):
    write_run_record(RunRecord("nats://127.0.0.1:4999", "default", "http://x/v1", os.getpid()))
    assert resolve_nats_url("nats://flag:1") == ("nats://flag:1", "--nats-url")
    monkeypatch.setenv("KVMESH_NATS_URL", "nats://env:2")
    assert resolve_nats_url(None) == ("nats://env:2", "KVMESH_NATS_URL")


def test_a_mesh_removes_only_its_own_record():
    write_run_record(RunRecord("nats://127.0.0.1:4999", "default", "http://x/v1", os.getpid()))
    remove_run_record("default", pid=os.getpid() + 1)  # another mesh stopping: not its record
    assert run_file("default").exists()
    remove_run_record("default", pid=os.getpid())
    assert not run_file("default").exists()


def test_a_corrupt_record_reads_as_none():
    run_file("default").write_text("{not json")
    assert read_run_record("default") is None
