"""A worker advertises how its prefills meet their decode workers (the engine's way, not a router
flag): the mock engine bootstrap, vLLM sync, a mock worker told --kv-handoff sync behaves as vLLM."""

from __future__ import annotations

import pytest

from kvmesh.worker.config import WorkerConfig
from tests.support import service_config


def test_each_engine_has_its_own_way_and_a_mock_worker_may_take_the_other():
    assert service_config(WorkerConfig, []).resolved_kv_handoff() == "bootstrap"
    assert service_config(WorkerConfig, ["--engine", "vllm"]).resolved_kv_handoff() == "sync"
    assert service_config(WorkerConfig, ["--kv-handoff", "sync"]).resolved_kv_handoff() == "sync"


def test_vllm_cannot_take_the_bootstrap_way(capsys):
    with pytest.raises(SystemExit):
        service_config(WorkerConfig, ["--engine", "vllm", "--kv-handoff", "bootstrap"])
    assert "vLLM's KV connector needs sync" in capsys.readouterr().err
