"""TLS for the gRPC request path (frontend → router → worker, router → indexer, the tools).

One setting per process, made once at start-up: a service from its options (``--grpc-tls-cert``,
``--grpc-tls-key``, ``--grpc-tls-ca``), a tool from ``KVMESH_GRPC_TLS_*``. With a certificate and key
the process's gRPC server speaks TLS only; with a CA its channels speak TLS and check the peer's
certificate against it (a name matching the address it dials: an IP address or DNS name in the
certificate's subject alternative names). Without any, everything stays plain text, as before.
A process-wide setting rather than an argument: channels are opened deep inside every service
(pools, recovery, the client), and one process never needs two policies (decision 14).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = ["GrpcTls", "configure", "current"]

_ENV = {"cert": "KVMESH_GRPC_TLS_CERT", "key": "KVMESH_GRPC_TLS_KEY", "ca": "KVMESH_GRPC_TLS_CA"}


@dataclass(frozen=True)
class GrpcTls:
    """Guarantees: :meth:`server_credentials` is None exactly when no certificate is set and
    :meth:`channel_credentials` exactly when no CA is set (plain text)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> GrpcTls:
        environ = os.environ if environ is None else environ
        return cls(**{name: environ.get(variable) or None for name, variable in _ENV.items()})

    def environment(self) -> dict[str, str]:
        """The variables that hand this setting to a child process."""
        return {_ENV[name]: value for name, value in vars(self).items() if value}

    def validate(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
        for path in (self.cert, self.key, self.ca):
            if path and not Path(path).is_file():
                raise ValueError(f"{path}: no such file")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.cert or not self.key:
            return None
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())])

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.ca:
            return None
        return grpc.ssl_channel_credentials(root_certificates=Path(self.ca).read_bytes())


_current: GrpcTls | None = None


def configure(setting: GrpcTls) -> None:
    """Set this process's policy (a service, at start-up, from its options)."""
    global _current
    setting.validate()
    _current = setting


def current() -> GrpcTls:
    """The policy :func:`configure` set, else the one ``KVMESH_GRPC_TLS_*`` describe."""
    return _current if _current is not None else GrpcTls.from_environment()
