"""NATS with authentication and TLS: services, `kvmesh up` and the tools connect with the right
credentials and fail fast, naming the URL and the reason, without them. Real nats-server processes
started with user/password, a token, TLS and mutual TLS (certificates made here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nats
import openai
import pytest

from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.runtime.nats_auth import NatsCredentials
from kvmesh.common.runtime.nats_server import EmbeddedNatsServer
from kvmesh.devtools.mesh_process import MeshProcess
from tests.certificates import make_certificates
from tests.nats_jwt import operator_setup
from tests.support import registered, wait_until_async

pytestmark = pytest.mark.integration


def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A kvmesh command with a short connect timeout and no credentials but those given."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_NATS_")}
    return subprocess.run(
        [sys.executable, "-m", *argv, "--nats-connect-timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **(env or {})},
    )


async def registered_workers(url: str, credentials: NatsCredentials) -> int:
    nc = await nats.connect(url, **credentials.connect_options())
    watcher = DiscoveryWatcher(nc.jetstream(), "default", "worker")
    await watcher.start()
    try:
        await wait_until_async(lambda: watcher.instances(), what="a worker registered")
        return len(watcher.instances())
    finally:
        await watcher.stop()
        await nc.close()


@pytest.fixture
async def password_server():
    credentials = NatsCredentials(user="kvmesh", password="s3cret")
    server = await EmbeddedNatsServer(
        server_args=["--user", "kvmesh", "--pass", "s3cret"], credentials=credentials
    ).start()
    yield server, credentials
    server.stop()


async def test_user_and_password_from_flags_or_the_environment(password_server):
    server, _credentials = password_server
    refused = run(["kvmesh", "inspect", "worker", "--nats-url", server.url])
    assert refused.returncode != 0
    assert f"cannot connect to NATS at {server.url}" in refused.stderr and "uthoriz" in refused.stderr
    assert "the login was refused" in refused.stderr

    with_env = run(
        ["kvmesh", "inspect", "worker", "--nats-url", server.url],
        {"KVMESH_NATS_USER": "kvmesh", "KVMESH_NATS_PASSWORD": "s3cret"},
    )
    assert with_env.returncode == 0, with_env.stderr


async def test_kvmesh_up_hands_the_credentials_to_every_service(password_server):
    server, credentials = password_server
    mesh = MeshProcess(
        "--nats-url", server.url, "--nats-user", "kvmesh", "--nats-password", "s3cret", "--workers", "1"
    ).start()
    try:
        assert all("s3cret" not in line for line in mesh.output)  # never logged
        answer = openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0).completions.create(
            model="kvmesh-tiny", prompt="authenticated", max_tokens=3
        )
        assert answer.usage.completion_tokens == 3
        assert await registered_workers(server.url, credentials) == 1
    finally:
        assert mesh.stop() == 0


async def test_a_token():
    server = await EmbeddedNatsServer(
        server_args=["--auth", "t0ken"], credentials=NatsCredentials(token="t0ken")
    ).start()
    try:
        assert run(["kvmesh.router", "--nats-url", server.url]).returncode != 0
        ok = run(["kvmesh", "inspect", "router", "--nats-url", server.url], {"KVMESH_NATS_TOKEN": "t0ken"})
        assert ok.returncode == 0, ok.stderr
    finally:
        server.stop()


async def test_tls_and_mutual_tls(tmp_path: Path):
    files = make_certificates(tmp_path)
    client = NatsCredentials(
        tls_ca=str(files["ca"]), tls_cert=str(files["client_cert"]), tls_key=str(files["client_key"])
    )
    server = await EmbeddedNatsServer(
        server_args=[
            "--tlsverify",  # the server asks for a client certificate too: mutual TLS
            "--tlscert",
            str(files["server_cert"]),
            "--tlskey",
            str(files["server_key"]),
            "--tlscacert",
            str(files["ca"]),
        ],
        credentials=client,
    ).start()
    try:
        plain = run(["kvmesh", "inspect", "worker", "--nats-url", server.url])
        assert plain.returncode != 0 and f"cannot connect to NATS at {server.url}" in plain.stderr
        no_client_cert = run(
            ["kvmesh", "inspect", "worker", "--nats-url", server.url], {"KVMESH_NATS_TLS_CA": str(files["ca"])}
        )
        assert no_client_cert.returncode != 0
        router = run(
            ["kvmesh", "inspect", "router", "--nats-url", server.url],
            {
                "KVMESH_NATS_TLS_CA": str(files["ca"]),
                "KVMESH_NATS_TLS_CERT": str(files["client_cert"]),
                "KVMESH_NATS_TLS_KEY": str(files["client_key"]),
            },
        )
        assert router.returncode == 0, router.stderr
    finally:
        server.stop()


@pytest.fixture
async def operator_mode_server(tmp_path: Path):
    """A nats-server in operator (JWT) mode and the path of a user ``.creds`` file it accepts."""
    setup = operator_setup(tmp_path)
    credentials = NatsCredentials(creds_file=str(setup.creds_file))
    server = await EmbeddedNatsServer(server_args=["-c", str(setup.server_config)], credentials=credentials).start()
    yield server, setup.creds_file
    server.stop()


async def test_a_creds_file_from_the_environment_in_operator_mode(operator_mode_server):
    server, creds_file = operator_mode_server
    assert run(["kvmesh", "inspect", "worker", "--nats-url", server.url]).returncode != 0
    ok = run(["kvmesh", "inspect", "worker", "--nats-url", server.url], {"KVMESH_NATS_CREDS": str(creds_file)})
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("service", ["indexer", "router", "worker", "frontend"])
async def test_a_service_without_the_creds_file_is_refused_in_operator_mode(operator_mode_server, service):
    server, _creds_file = operator_mode_server
    refused = run([f"kvmesh.{service}", "--nats-url", server.url])
    assert refused.returncode != 0
    assert f"cannot connect to NATS at {server.url}" in refused.stderr and "uthoriz" in refused.stderr
    # given up at the refusal, not after retrying it until the connect timeout
    assert "the login was refused" in refused.stderr


async def test_the_nats_creds_flag_reaches_every_service_of_kvmesh_up_and_a_standalone_worker(
    operator_mode_server,
):
    """``--nats-creds`` on the command line, no environment: `kvmesh up` hands it to its indexer,
    router, worker, frontend and planner, and they serve; a worker started alone with the flag joins."""
    server, creds_file = operator_mode_server
    credentials = NatsCredentials(creds_file=str(creds_file))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_NATS_")}
    assert clean == dict(os.environ), "this test's own environment must carry no NATS credentials"
    mesh = MeshProcess(
        *("--nats-url", server.url, "--nats-creds", str(creds_file), "--workers", "1", "--planner"),
        *("--min-workers", "1", "--max-workers", "2"),
    ).start()
    worker = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.worker", "--nats-url", server.url, "--nats-creds", str(creds_file)],
        env={**clean, "PYTHONUNBUFFERED": "1"},
    )
    try:
        answer = openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0).completions.create(
            model="kvmesh-tiny", prompt="authenticated by a JWT", max_tokens=3
        )
        assert answer.usage.completion_tokens == 3
        nc = await nats.connect(server.url, **credentials.connect_options())
        try:
            for component in ("indexer", "router"):
                assert await registered(nc, "default", component), f"no {component} registered"
            # the planner registers nowhere; it says when it has taken its lease in NATS
            await wait_until_async(
                lambda: any("planner ready" in line for line in mesh.output), timeout=30, what="the planner"
            )

            async def both_workers() -> bool:
                return len(await registered(nc, "default", "worker")) == 2

            await wait_until_async(both_workers, timeout=30, what="the standalone worker registered")
        finally:
            await nc.close()
    finally:
        worker.terminate()
        assert worker.wait(timeout=30) == 0
        assert mesh.stop() == 0


def test_a_missing_credentials_file_is_a_clear_error():
    result = run(
        ["kvmesh", "inspect", "worker", "--nats-url", "nats://127.0.0.1:1"], {"KVMESH_NATS_CREDS": "/nonexistent.creds"}
    )
    assert result.returncode != 0 and "/nonexistent.creds: no such file" in result.stderr
