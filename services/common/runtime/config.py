"""Typed service configuration built from flags and environment variables.

Each service declares one dataclass whose fields are made with :func:`option`. :func:`parse_config`
turns it into an ``argparse`` parser (so ``--help`` documents every knob and its environment
variable), reads ``KVMESH_<FIELD>`` environment variables as defaults, and returns the typed object.
Precedence: command-line flag, then environment variable, then the declared default.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import socket
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from kvmesh.common.wire import names

ENV_PREFIX = "KVMESH_"

ConfigT = TypeVar("ConfigT")


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message says which and why."""


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: Sequence[Any] | None = None,
    positional: bool = False,
    passthrough: bool = False,
    secret: bool = False,
) -> Any:
    """Declare one configuration field: its default, its help text and optionally its flag name.

    A ``positional`` field is a required command-line argument (no flag, no environment variable).
    A ``passthrough`` field (a list) receives the arguments the parser does not know, for a component
    with a parser of its own (vLLM's engine arguments); ``validate`` decides whether any are allowed.
    """
    metadata = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "positional": positional,
        "passthrough": passthrough,
        "secret": secret,  # never logged: describe() masks it
    }
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def options_argv(options_class: type, config: Any) -> list[str]:
    """The command-line flags that reproduce ``config``'s values of the fields ``options_class``
    declares (``kvmesh up`` hands its option groups to its services this way). A ``secret`` field is
    left out: it travels in the child's environment (``secret_env``), never on a command line."""
    argv: list[str] = []
    for f in dataclasses.fields(options_class):
        if f.metadata.get("secret"):
            continue
        value = getattr(config, f.name)
        flag = flag_name(f)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def secret_env(options_class: type, config: Any) -> dict[str, str]:
    """The environment that hands ``config``'s ``secret`` values of ``options_class`` to a child
    service (the ``KVMESH_*`` variables it reads them from)."""
    return {
        env_var_name(f.name): str(getattr(config, f.name))
        for f in dataclasses.fields(options_class)
        if f.metadata.get("secret") and getattr(config, f.name) is not None
    }


def env_var_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation such as ``int``, ``str | None``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def _convert(raw: str, kind: type, name: str) -> Any:
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{env_var_name(name)}={raw!r} is not a boolean (use true or false)")
    try:
        return kind(raw)
    except ValueError as exc:
        raise ConfigError(f"{env_var_name(name)}={raw!r} is not a valid {kind.__name__}") from exc


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        # no abbreviations: an engine flag such as vLLM's --model must not pass for --model-name
        allow_abbrev=False,
    )
    hints = typing.get_type_hints(cls)
    for title, group_fields in _option_groups(cls):
        group = parser if title is None else parser.add_argument_group(title)
        for f in group_fields:
            _add_argument(group, f, hints[f.name])
    return parser


def _option_groups(cls: type) -> list[tuple[str | None, list[dataclasses.Field]]]:
    """The fields of ``cls`` grouped by the class that declares them: its own first (untitled), then
    each option set it inherits, titled by the first line of that set's docstring."""
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    groups: list[tuple[str | None, list[dataclasses.Field]]] = []
    seen: set[str] = set()
    for klass in cls.__mro__:
        own = [by_name[name] for name in vars(klass).get("__annotations__", {}) if name in by_name and name not in seen]
        if not own:
            continue
        seen.update(f.name for f in own)
        title = None if klass is cls else (klass.__doc__ or klass.__name__).strip().splitlines()[0].rstrip(".")
        groups.append((title, own))
    return groups


def _add_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, f: dataclasses.Field, hint: Any) -> None:
    if f.metadata.get("passthrough"):
        return
    kind, _optional = _base_type(hint)
    if f.metadata.get("positional"):
        parser.add_argument(f.name, type=kind, help=f.metadata.get("help", ""))
        return
    flag = flag_name(f)
    help_text = f"{f.metadata.get('help', '')} [env {env_var_name(f.name)}]"
    if kind is bool:
        parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
    else:
        parser.add_argument(
            flag, dest=f.name, type=kind, default=f.default, choices=f.metadata.get("choices"), help=help_text
        )


def parse_config(
    cls: type[ConfigT],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    environ: Mapping[str, str] | None = None,
) -> ConfigT:
    """Parse ``argv`` over environment defaults into an instance of the dataclass ``cls``."""
    environ = os.environ if environ is None else environ
    parser = build_parser(cls, prog, description)
    hints = typing.get_type_hints(cls)
    env_defaults: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        skip_env = f.metadata.get("positional") or f.metadata.get("passthrough")
        raw = None if skip_env else environ.get(env_var_name(f.name))
        if raw is not None:
            kind, _ = _base_type(hints[f.name])
            try:
                env_defaults[f.name] = _convert(raw, kind, f.name)
            except ConfigError as exc:
                parser.error(str(exc))
    parser.set_defaults(**env_defaults)
    passthrough = [f.name for f in dataclasses.fields(cls) if f.metadata.get("passthrough")]
    if passthrough:
        namespace, unknown = parser.parse_known_args(argv)
        setattr(namespace, passthrough[0], unknown)
    else:
        namespace = parser.parse_args(argv)
    config = cls(**vars(namespace))
    mesh = getattr(config, "namespace", None)
    if isinstance(mesh, str) and (problem := names.namespace_problem(mesh)) is not None:
        parser.error(f"--namespace: {problem}")
    validate = getattr(config, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as exc:
            parser.error(str(exc))
    return config


def describe(config: Any) -> dict[str, Any]:
    """The configuration as a flat dict, for the start-up log line; secrets (API keys, passwords)
    show only whether they are set."""
    described = dataclasses.asdict(config)
    for f in dataclasses.fields(config):
        if f.metadata.get("secret") and described.get(f.name) is not None:
            described[f.name] = "<set>"
    return described


@dataclasses.dataclass
class CommonConfig:
    """Options every service shares."""

    nats_url: str = option(
        "nats://127.0.0.1:4222",
        "NATS server URL; several, comma-separated, for a cluster (nats://a:4222,nats://b:4222): any one that "
        "answers will do, and the connection fails over among them",
    )
    nats_connect_timeout: float | None = option(
        None,
        "seconds to wait for the first connection to NATS before giving up (default 5, or "
        "$KVMESH_NATS_CONNECT_TIMEOUT); a login every server refuses fails at once; reconnects after it are "
        "unlimited",
    )
    jetstream_replicas: int | None = option(
        None,
        "replicas of every JetStream stream, KV bucket and object store kvmesh creates (default: 3 on a NATS "
        "cluster of three or more servers, else 1); an existing one with fewer is raised to it",
    )
    nats_user: str | None = option(None, "NATS user name (with --nats-password)")
    nats_password: str | None = option(None, "NATS password", secret=True)
    nats_token: str | None = option(None, "NATS authentication token", secret=True)
    nats_creds: str | None = option(None, "NATS credentials file (.creds: JWT and NKey seed)")
    nats_tls_ca: str | None = option(None, "CA certificate to check NATS's TLS certificate with (turns TLS on)")
    nats_tls_cert: str | None = option(None, "client certificate for NATS (mutual TLS; with --nats-tls-key)")
    nats_tls_key: str | None = option(None, "client certificate's private key for NATS")
    grpc_tls_ca: str | None = option(
        None, "CA certificate to check the gRPC servers this service calls with (turns TLS on for its calls)"
    )
    namespace: str = option("default", "namespace that isolates one mesh's subjects and keys")
    log_level: str = option("info", "log level", choices=("debug", "info", "warning", "error"))
    log_json: bool | None = option(None, "JSON logs (default: JSON unless stderr is a terminal)")


@dataclasses.dataclass
class GrpcEndpointConfig(CommonConfig):
    """Options of a service that serves gRPC and registers its address in discovery."""

    host: str = option("127.0.0.1", "address the gRPC server binds")
    port: int = option(0, "gRPC port (0 picks a free one)")
    advertise_host: str | None = option(
        None,
        "host name others use to reach this service (default: --host); `auto`: the address this host's name "
        "resolves to (in a container on a bridge network: the container's own, so replicas can share one command)",
    )
    grpc_tls_cert: str | None = option(
        None, "certificate the gRPC server presents (serves TLS only; with --grpc-tls-key)"
    )
    grpc_tls_key: str | None = option(None, "the gRPC server certificate's private key")
    lease_ttl: float = option(6.0, "discovery lease in seconds; refreshed every third of it")
    drain_timeout_secs: float = option(
        5.0,
        "on SIGTERM, after deregistering: seconds the calls in flight may take to finish before they are "
        "cut (a worker's or router's cut streams continue elsewhere)",
    )
    metrics_port: int = option(0, "Prometheus /metrics port (0: a free port, advertised in discovery; -1: off)")

    def advertised_address(self, bound_port: int) -> str:
        return f"{advertised_host(self)}:{bound_port}"


ADVERTISE_AUTO = "auto"


def advertised_host(config: Any) -> str:
    """The host others reach ``config``'s service at: ``--advertise-host`` (``auto`` resolved), else ``--host``."""
    if config.advertise_host == ADVERTISE_AUTO:
        return _own_address()
    return config.advertise_host or config.host


@functools.cache
def _own_address() -> str:
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise ConfigError(f"--advertise-host auto: this host's name {name!r} does not resolve ({exc})") from exc
