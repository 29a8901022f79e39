"""How a service proves itself to NATS and checks NATS's identity: user and password, a token, a
``.creds`` file (JWT and NKey), and TLS (a CA to trust, a client certificate for mutual TLS).

Every service takes them as options (``--nats-user`` ... or ``KVMESH_NATS_USER`` ...); tools
(``kvmesh inspect``, the client) read the same environment variables. Secrets are passed to child
processes through the environment, never on a command line, and never logged.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvmesh.common.runtime.config import env_var_name

__all__ = ["OPTIONS", "NatsCredentials"]

# Each credential's service option (``CommonConfig``): the one declaration of its name. The flag
# (``--nats-creds``) and the environment variable (``KVMESH_NATS_CREDS``) both derive from it, so a
# field here can never again look for an option that does not exist (``creds_file`` once looked for
# ``nats_creds_file`` and every service dropped ``--nats-creds`` without a word).
OPTIONS = {
    "user": "nats_user",
    "password": "nats_password",
    "token": "nats_token",
    "creds_file": "nats_creds",
    "tls_ca": "nats_tls_ca",
    "tls_cert": "nats_tls_cert",
    "tls_key": "nats_tls_key",
}
_ENV = {name: env_var_name(option) for name, option in OPTIONS.items()}


@dataclass(frozen=True)
class NatsCredentials:
    """Guarantees: :meth:`connect_options` gives nats-py exactly what was set (nothing when nothing
    was), and a TLS option alone turns TLS on (the server's certificate checked against ``tls_ca``,
    or the system's trust store)."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> NatsCredentials:
        """From a service's options (``nats_user``, ``nats_password``, ``nats_creds``, ...: see
        :data:`OPTIONS`). A config without one of them is a programming error and raises
        ``AttributeError``: a credential is never silently dropped."""
        return cls(**{name: getattr(config, option) for name, option in OPTIONS.items()})

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> NatsCredentials:
        environ = os.environ if environ is None else environ
        return cls(**{name: environ.get(variable) or None for name, variable in _ENV.items()})

    def environment(self) -> dict[str, str]:
        """The variables that hand these credentials to a child process."""
        return {_ENV[f.name]: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def validate(self) -> None:
        if bool(self.user) != bool(self.password):
            raise ValueError("--nats-user and --nats-password go together")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together")
        for path in (self.creds_file, self.tls_ca, self.tls_cert, self.tls_key):
            if path and not os.path.isfile(path):
                raise ValueError(f"{path}: no such file")

    def connect_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.user:
            options["user"], options["password"] = self.user, self.password
        if self.token:
            options["token"] = self.token
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        if self.uses_tls:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            options["tls"] = context
        return options
