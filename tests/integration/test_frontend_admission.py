"""What a request must pass at the frontend: an API key (Bearer, from the flag, a file or the
environment), a body size limit (413) and a limit on requests in flight (503 with Retry-After).
Real frontend, router and mock worker; the official openai client and httpx as clients."""

from __future__ import annotations

import contextlib

import httpx
import openai
import pytest

from kvmesh.common.runtime.config import parse_config
from kvmesh.frontend import server as frontend_server
from kvmesh.frontend.config import FrontendConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import free_port, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
BODY = {"model": "kvmesh-tiny", "prompt": "hello", "max_tokens": 4}


@contextlib.asynccontextmanager
async def mesh(nats_url: str, namespace: str, *frontend_args: str, environ: dict[str, str] | None = None):
    """A worker, a router and a frontend whose options come from ``frontend_args`` and ``environ``."""
    port = free_port()
    argv = [*common_args(nats_url, namespace), "--http-port", str(port), *frontend_args]
    frontend_config = parse_config(FrontendConfig, argv, prog="frontend", description="", environ=environ or {})
    common = common_args(nats_url, namespace)
    async with (
        running(worker_server.serve, service_config(WorkerConfig, [*common, "--speedup-ratio", "1"])),
        running(router_server.serve, service_config(RouterConfig, common)),
        running(frontend_server.serve, frontend_config),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
    ):

        async def serving() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return (await http.get("/health")).status_code == 200
            return False

        await wait_until_async(serving, what="the frontend serving")
        yield http


def common_args(nats_url: str, namespace: str) -> list[str]:
    return ["--nats-url", nats_url, "--namespace", namespace]


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


async def test_api_keys_from_the_flag_and_a_file_are_required_as_bearer_tokens(nats_url: str, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# one key per line\nfile-key\n")
    async with mesh(nats_url, "keys", "--api-key", "flag-key", "--api-key-file", str(key_file)) as http:
        assert error_of(await http.post("/v1/completions", json=BODY), 401)["code"] == "invalid_api_key"
        wrong = await http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"})
        assert error_of(wrong, 401)["type"] == "invalid_request_error"
        assert (await http.get("/health")).status_code == 200  # probes need no key
        assert (await http.get("/metrics")).status_code == 200
        base = f"{str(http.base_url).rstrip('/')}/v1"
        for key in ("flag-key", "file-key"):
            client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
            answer = await client.completions.create(model="kvmesh-tiny", prompt="hello", max_tokens=3)
            assert answer.usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=base, api_key="stolen", max_retries=0).models.list()


async def test_the_key_can_come_from_the_environment(nats_url: str):
    async with mesh(nats_url, "envkey", environ={"KVMESH_API_KEY": "env-key"}) as http:
        assert (await http.post("/v1/completions", json=BODY)).status_code == 401
        ok = await http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer env-key"})
        assert ok.status_code == 200


async def test_a_body_past_the_limit_is_a_413_declared_or_chunked(nats_url: str):
    async with mesh(nats_url, "bodies", "--max-request-body-bytes", "1000") as http:
        big = {**BODY, "prompt": "x" * 2000}
        assert "1000 bytes" in error_of(await http.post("/v1/completions", json=big), 413)["message"]

        async def chunks():
            for _ in range(20):
                yield b" " * 100  # no Content-Length: the frontend counts as it reads

        chunked = await http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        error_of(chunked, 413)
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200  # still serving


async def test_one_request_past_the_concurrency_limit_is_a_503_with_retry_after(nats_url: str):
    async with mesh(nats_url, "busy", "--max-concurrent-requests", "2") as http:
        long = {**BODY, "max_tokens": 100_000, "stream": True}
        streams = []
        for _ in range(2):  # two streams at real speed hold both slots
            response = await http.send(http.build_request("POST", "/v1/completions", json=long), stream=True)
            assert response.status_code == 200
            streams.append(response)
        refused = await http.post("/v1/completions", json=BODY)
        assert error_of(refused, 503)["code"] == "too_many_concurrent_requests"
        assert refused.headers["retry-after"] == "1"
        assert (await http.get("/health")).status_code == 200
        for response in streams:
            await response.aclose()

        async def admitted() -> bool:
            return (await http.post("/v1/completions", json=BODY)).status_code == 200

        await wait_until_async(admitted, what="a slot freed once the streams closed")
