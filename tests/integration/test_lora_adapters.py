"""LoRA adapters on the mock engine, through real services and the official openai client: a model
name can name an adapter, workers advertise theirs, the router keeps a request to workers that serve
its adapter, and an adapter's cached blocks are its own."""

from __future__ import annotations

import contextlib

import grpc
import httpx
import openai
import pytest
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import common_pb2, worker_pb2_grpc
from kvmesh.common.wire.requests import WORKER_ID_HEADER
from kvmesh.frontend import server as frontend_server
from kvmesh.frontend.config import FrontendConfig
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import free_port, registered, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "lora"
PROMPT = "Translate this question into SQL: which customers ordered more than three times last month? " * 2


async def registered_workers(nc: NatsClient, count: int) -> list:
    async def all_there() -> bool:
        return len(await registered(nc, NAMESPACE, "worker")) == count

    await wait_until_async(all_there, what=f"{count} workers")
    return await registered(nc, NAMESPACE, "worker")


async def ask(client: openai.AsyncOpenAI, model: str, prompt: str = PROMPT) -> tuple[int, int]:
    """(the worker that served it, its cached prompt tokens)."""
    raw = await client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=2)
    answer = raw.parse()
    assert answer.model == model  # answered under the name asked for, as vLLM does
    return int(raw.headers[WORKER_ID_HEADER]), answer.usage.prompt_tokens_details.cached_tokens


async def test_requests_for_an_adapter_go_to_its_workers_and_never_share_blocks(nats_url: str, nc: NatsClient):
    args = ["--nats-url", nats_url, "--namespace", NAMESPACE]
    port = free_port()
    async with (
        running(worker_server.serve, service_config(WorkerConfig, [*args, "--lora-adapters", "sql,chat"])),
        running(worker_server.serve, service_config(WorkerConfig, args)),
        running(indexer_server.serve, service_config(IndexerConfig, args)),
        running(router_server.serve, service_config(RouterConfig, args)),
        running(frontend_server.serve, service_config(FrontendConfig, [*args, "--http-port", str(port)])),
        openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as client,
    ):
        workers = await registered_workers(nc, 2)
        with_adapters = next(w for w in workers if w.extra.get("lora_adapters"))
        assert with_adapters.extra["lora_adapters"] == ["sql", "chat"]

        async def ready() -> bool:
            with contextlib.suppress(openai.APIConnectionError, httpx.HTTPError):  # not listening yet
                listed = {m.id for m in (await client.models.list()).data} == {"kvmesh-tiny", "sql", "chat"}
                async with httpx.AsyncClient() as http:  # /health says 200 once the frontend knows a router
                    return listed and (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200
            return False

        await wait_until_async(ready, what="the adapters listed as models, and a router known")
        assert {m.id: getattr(m, "parent", None) for m in (await client.models.list()).data}["sql"] == "kvmesh-tiny"

        # distinct prompts, which load balancing would spread: only one worker serves the adapter
        spread = [await ask(client, "sql", f"question {i}: " + PROMPT) for i in range(6)]
        assert {worker for worker, _ in spread} == {with_adapters.instance_id}
        served = [await ask(client, "sql") for _ in range(3)]
        assert {worker for worker, _ in served} == {with_adapters.instance_id}
        assert served[0][1] == 0 and served[-1][1] > 0  # the adapter's own blocks are reused
        # the base model's request for the same prompt finds none of the adapter's blocks, wherever it goes,
        # and another adapter's neither
        assert (await ask(client, "kvmesh-tiny"))[1] == 0
        assert (await ask(client, "chat"))[1] == 0

        with pytest.raises(openai.NotFoundError) as unknown:
            await ask(client, "no-such-adapter")
        assert unknown.value.body["code"] == "model_not_found"

        # a worker asked directly for an adapter it does not serve says so
        plain = next(w for w in workers if w is not with_adapters)
        request = common_pb2.PreprocessedRequest(request_id="direct", token_ids=[1, 2, 3], lora_name="sql")
        request.stop.max_tokens = 1
        async with grpc.aio.insecure_channel(plain.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=10):
                    pass
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert "does not serve LoRA adapter 'sql'" in refused.value.details()


async def test_a_worker_that_must_load_the_adapter_is_charged_for_the_load(nats_url: str, nc: NatsClient):
    """Two workers serve sql and chat; "few" holds one adapter loaded at a time (--max-loras 1),
    "all" both. A request for the adapter "few" holds goes anywhere; one for the other goes to "all"
    (the router charges "few" the load), until a request makes "few" load it and say so."""
    args = ["--nats-url", nats_url, "--namespace", NAMESPACE]
    port = free_port()
    few_args = [*args, "--lora-adapters", "sql,chat", "--max-loras", "1", "--lora-load-ms", "20"]
    async with (
        running(worker_server.serve, service_config(WorkerConfig, few_args)),
        running(worker_server.serve, service_config(WorkerConfig, [*args, "--lora-adapters", "chat,sql"])),
        running(indexer_server.serve, service_config(IndexerConfig, args)),
        running(router_server.serve, service_config(RouterConfig, args)),
        running(frontend_server.serve, service_config(FrontendConfig, [*args, "--http-port", str(port)])),
        openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as client,
    ):
        workers = await registered_workers(nc, 2)
        few = next(w for w in workers if "lora_resident" in w.extra)
        everything = next(w for w in workers if w is not few)
        assert few.extra["lora_resident"] == ["sql"]  # the first --max-loras of its adapters start loaded
        assert "lora_resident" not in everything.extra  # it holds all it serves: nothing to advertise

        async def ready() -> bool:
            async with httpx.AsyncClient() as http:
                with contextlib.suppress(httpx.HTTPError):  # not listening yet
                    return (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200
            return False

        await wait_until_async(ready, what="a router known")
        # distinct prompts, which load balancing alone would spread over both
        chat = [(await ask(client, "chat", f"chat {i}: " + PROMPT))[0] for i in range(6)]
        assert set(chat) == {everything.instance_id}  # "few" would have to load chat first
        sql = [(await ask(client, "sql", f"sql {i}: " + PROMPT))[0] for i in range(8)]
        assert set(sql) == {few.instance_id, everything.instance_id}  # both hold it: balanced

        # a request sent to "few" for chat loads it there (evicting sql), and its record says so
        request = common_pb2.PreprocessedRequest(request_id="load-chat", token_ids=[1, 2, 3], lora_name="chat")
        request.stop.max_tokens = 1
        async with grpc.aio.insecure_channel(few.address) as channel:
            answers = [out async for out in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=10)]
        assert answers[-1].finish_reason

        async def chat_loaded() -> bool:
            record = next(w for w in await registered(nc, NAMESPACE, "worker") if w.instance_id == few.instance_id)
            return record.extra["lora_resident"] == ["chat"]

        await wait_until_async(chat_loaded, what="the worker's record to show chat loaded instead of sql")
        sql = [(await ask(client, "sql", f"sql again {i}: " + PROMPT))[0] for i in range(6)]
        assert set(sql) == {everything.instance_id}
