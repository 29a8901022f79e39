"""The kvmesh command picks gRPC core's I/O layer before gRPC loads (decision 25)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmesh.common.rpc.grpc_io import GRPC_EXPERIMENTS_ENV, IO_ENV, IOMGR_EXPERIMENTS, choose_grpc_io


def test_iomgr_is_the_default():
    environ: dict[str, str] = {}
    assert choose_grpc_io(environ) == IOMGR_EXPERIMENTS
    assert environ == {GRPC_EXPERIMENTS_ENV: IOMGR_EXPERIMENTS}


def test_the_event_engine_can_be_asked_for():
    environ = {IO_ENV: "event-engine"}
    assert choose_grpc_io(environ) is None
    assert GRPC_EXPERIMENTS_ENV not in environ


def test_the_users_own_grpc_experiments_are_kept():
    environ = {GRPC_EXPERIMENTS_ENV: "some_experiment"}
    assert choose_grpc_io(environ) is None
    assert environ[GRPC_EXPERIMENTS_ENV] == "some_experiment"


def test_an_unknown_choice_is_a_clear_error():
    with pytest.raises(SystemExit, match="KVMESH_GRPC_IO must be one of iomgr, event-engine, not 'epoll'"):
        choose_grpc_io({IO_ENV: "epoll"})


def test_the_command_sets_it_before_a_service_module_loads_grpc(tmp_path):
    # a stand-in command module reports what a real service module would find when it imports grpc
    (tmp_path / "probe_command.py").write_text(
        "import os, sys\ndef main(args):\n    print(os.environ.get('GRPC_EXPERIMENTS'), 'grpc' in sys.modules)\n"
    )
    code = "from kvmesh import cli; cli.COMMANDS['probe'] = ('probe_command', ''); cli.main(['probe'])"
    environ = {k: v for k, v in os.environ.items() if k not in (GRPC_EXPERIMENTS_ENV, IO_ENV)}
    environ["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [IOMGR_EXPERIMENTS, "False"]


@pytest.mark.parametrize("service", ["frontend", "router", "indexer", "worker", "planner"])
def test_each_service_module_sets_it_before_it_loads_grpc(service):
    # `python -m kvmesh.<service>` (what `kvmesh up` and the containers start) runs its __main__;
    # importing that module without running main shows what it sets and whether grpc came first
    code = (
        "import builtins, os, sys\n"
        "real_import = builtins.__import__\n"
        "def watch(name, *args, **kwargs):\n"
        "    if name == 'grpc' and 'grpc' not in sys.modules:\n"
        "        print('grpc loaded with', os.environ.get('GRPC_EXPERIMENTS'))\n"
        "    return real_import(name, *args, **kwargs)\n"
        "builtins.__import__ = watch\n"
        f"import kvmesh.{service}.__main__\n"
        "print('set', os.environ.get('GRPC_EXPERIMENTS'))\n"
    )
    environ = {k: v for k, v in os.environ.items() if k not in (GRPC_EXPERIMENTS_ENV, IO_ENV)}
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    assert said[-1] == f"set {IOMGR_EXPERIMENTS}"
    assert all(line == f"grpc loaded with {IOMGR_EXPERIMENTS}" for line in said[:-1])  # the planner has no gRPC
