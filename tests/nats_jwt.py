"""A NATS server in operator (JWT) mode and a user ``.creds`` file for it, made on the spot: an
operator, a system account, an account with JetStream, and one user, each key an NKey and each
claim a JWT signed by its issuer (NATS's decentralised authentication, as `nsc` would set it up).
For the ``--nats-creds`` test only."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import nkeys

__all__ = ["OperatorSetup", "operator_setup"]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _keypair(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def _public(key: nkeys.KeyPair) -> str:
    return key.public_key.decode()


def _jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats: dict) -> str:
    claims = {"iat": int(time.time()), "iss": _public(issuer), "name": name, "sub": subject, "nats": nats}
    # the claim id: a hash of the claims themselves
    digest = hashlib.sha512(json.dumps(claims, separators=(",", ":")).encode()).digest()[:32]
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    payload = _b64(json.dumps(claims, separators=(",", ":")).encode())
    signature = issuer.sign(f"{header}.{payload}".encode())
    return f"{header}.{payload}.{_b64(signature)}"


UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1}
JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


@dataclass(frozen=True)
class OperatorSetup:
    server_config: Path  # nats-server -c this
    creds_file: Path  # the user's credentials


def operator_setup(folder: Path) -> OperatorSetup:
    operator = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    system = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    user = _keypair(nkeys.PREFIX_BYTE_USER)
    operator_jwt = _jwt(operator, _public(operator), "kvmesh-test", {"type": "operator", "version": 2})
    account_claims = {"limits": {**UNLIMITED, **JETSTREAM}, "type": "account", "version": 2}
    system_jwt = _jwt(operator, _public(system), "SYS", {"limits": UNLIMITED, "type": "account", "version": 2})
    account_jwt = _jwt(operator, _public(account), "kvmesh", account_claims)
    user_claims = {"pub": {}, "sub": {}, **UNLIMITED, "type": "user", "version": 2}
    user_jwt = _jwt(account, _public(user), "kvmesh-user", user_claims)
    config = folder / "operator.conf"
    config.write_text(
        f"operator: {operator_jwt}\n"
        f"system_account: {_public(system)}\n"
        "resolver: MEMORY\n"
        f"resolver_preload: {{\n  {_public(system)}: {system_jwt}\n  {_public(account)}: {account_jwt}\n}}\n"
    )
    creds = folder / "user.creds"
    creds.write_text(
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_jwt}\n"
        "------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{user.seed.decode()}\n"
        "------END USER NKEY SEED------\n"
    )
    return OperatorSetup(config, creds)
