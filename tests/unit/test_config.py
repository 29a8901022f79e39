from dataclasses import dataclass

import pytest

from kvmesh.common.config import CommonConfig, ConfigError, option, parse_config


@dataclass
class SampleConfig(CommonConfig):
    port: int = option(0, "a port")
    ratio: float = option(1.0, "a ratio")
    enabled: bool = option(False, "a switch")
    name: str | None = option(None, "an optional name")

    def validate(self) -> None:
        if self.ratio <= 0:
            raise ConfigError("--ratio must be positive")


def parse(argv, env=None):
    return parse_config(SampleConfig, argv, prog="t", description="d", environ=env or {})


def test_defaults():
    config = parse([])
    assert (config.port, config.ratio, config.enabled, config.name) == (0, 1.0, False, None)
    assert config.nats_url.startswith("nats://")


def test_environment_then_flags_take_precedence():
    env = {"KVMESH_PORT": "9000", "KVMESH_ENABLED": "true", "KVMESH_NAME": "env"}
    assert (parse([], env).port, parse([], env).enabled, parse([], env).name) == (9000, True, "env")
    config = parse(["--port", "9100", "--no-enabled"], env)
    assert (config.port, config.enabled) == (9100, False)


def test_bad_values_exit_with_a_clear_message(capsys):
    with pytest.raises(SystemExit):
        parse(["--ratio", "0"])
    assert "--ratio must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse([], {"KVMESH_PORT": "eighty"})
    assert "KVMESH_PORT" in capsys.readouterr().err


def test_help_names_the_environment_variable(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    assert "KVMESH_RATIO" in capsys.readouterr().out
