"""Every NATS credential a service's options declare reaches the connection it configures, from a
flag or from the environment, in every command that connects (``--nats-creds`` was once dropped by
all of them: the option and the credential it fed had drifted apart in name)."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.common.runtime.config import CommonConfig, env_var_name, flag_name, parse_config
from kvmesh.common.runtime.nats_auth import OPTIONS, NatsCredentials
from kvmesh.frontend.config import FrontendConfig
from kvmesh.indexer.config import IndexerConfig
from kvmesh.planner.service import PlannerConfig
from kvmesh.router.config import RouterConfig
from kvmesh.up.config import UpConfig
from kvmesh.worker.config import WorkerConfig

COMMANDS = [IndexerConfig, RouterConfig, WorkerConfig, FrontendConfig, PlannerConfig, UpConfig]

# what each command needs besides (the planner plans with a measured engine profile)
REQUIRED = {PlannerConfig: ["--engine-profile", "profile.json"]}

# a distinct value per credential, so a value arriving in the wrong field shows
VALUES = {name: f"/etc/kvmesh/{name}" for name in OPTIONS}


def declared(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def test_every_credential_names_an_option_every_service_declares():
    common = {f.name for f in dataclasses.fields(CommonConfig)}
    assert set(OPTIONS) == {f.name for f in dataclasses.fields(NatsCredentials)}
    assert set(OPTIONS.values()) <= common
    # and every nats_* option of CommonConfig that is a credential is read by one
    credential_like = {name for name in common if name.startswith("nats_") and name not in ("nats_url",)}
    assert credential_like - set(OPTIONS.values()) == {"nats_connect_timeout"}


@pytest.mark.parametrize("cls", COMMANDS, ids=lambda c: c.__name__)
def test_credentials_from_flags_reach_the_connection(cls):
    argv = list(REQUIRED.get(cls, []))
    for name, option in OPTIONS.items():
        argv += [flag_name(declared(cls, option)), VALUES[name]]
    config = parse_config(cls, argv, prog="t", description="d", environ={})
    assert NatsCredentials.from_config(config) == NatsCredentials(**VALUES)


@pytest.mark.parametrize("cls", COMMANDS, ids=lambda c: c.__name__)
def test_credentials_from_the_environment_reach_the_connection(cls):
    environ = {env_var_name(option): VALUES[name] for name, option in OPTIONS.items()}
    config = parse_config(cls, REQUIRED.get(cls, []), prog="t", description="d", environ=environ)
    credentials = NatsCredentials.from_config(config)
    assert credentials == NatsCredentials(**VALUES)
    # a child service handed them through the environment reads the same ones
    assert NatsCredentials.from_environment(credentials.environment()) == credentials


def test_the_creds_flag_is_the_connections_user_credentials(tmp_path):
    creds = tmp_path / "user.creds"
    creds.write_text("not read here")
    config = parse_config(WorkerConfig, ["--nats-creds", str(creds)], prog="t", description="d", environ={})
    assert NatsCredentials.from_config(config).connect_options() == {"user_credentials": str(creds)}
