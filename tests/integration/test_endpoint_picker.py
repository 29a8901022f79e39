"""The endpoint picker (frontend --ext-proc-port) driven as a Gateway API Inference Extension gateway
drives it: Envoy's ext_proc messages over gRPC (Envoy's published protos), against a real mesh on
real NATS. Buffered and full-duplex bodies, KV-aware choices, completion freeing the load, a client
that goes away, bad bodies, and workers that cannot be named."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from nats.aio.client import Client as NatsClient

from kvmesh.common.proto.kvmesh.v1 import router_pb2, router_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.wire.gateway_endpoint import DESTINATION_HEADER, METADATA_NAMESPACE
from kvmesh.frontend import server as frontend_server
from kvmesh.frontend.config import FrontendConfig
from kvmesh.indexer import server as indexer_server
from kvmesh.indexer.config import IndexerConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import free_port, running, service_config, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "picker"
MODEL = "kvmesh-tiny"
ENDPOINTS = ("10.9.0.1:8000", "10.9.0.2:8000")
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BodySendMode.BUFFERED


class Gateway:
    """One ext_proc stream, as Envoy holds it for one HTTP request."""

    def __init__(self, stub: ext_proc_grpc.ExternalProcessorStub) -> None:
        self._outbox: asyncio.Queue[ext_proc.ProcessingRequest | None] = asyncio.Queue()
        self._call = stub.Process(self._messages())

    async def _messages(self) -> AsyncIterator[ext_proc.ProcessingRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    def send(self, message: ext_proc.ProcessingRequest) -> None:
        self._outbox.put_nowait(message)

    async def receive(self) -> ext_proc.ProcessingResponse:
        return await asyncio.wait_for(self._call.read(), timeout=15)

    def headers(self, path: str = "/v1/chat/completions", mode: int | None = None, **extra: str) -> None:
        pairs = {":method": "POST", ":path": path, "content-type": "application/json", **extra}
        message = ext_proc.ProcessingRequest(request_headers=_headers(pairs, end_of_stream=False))
        if mode is not None:
            message.protocol_config.request_body_mode = mode
            message.protocol_config.response_body_mode = mode
        self.send(message)

    def body(self, data: bytes, end: bool = True) -> None:
        self.send(ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=data, end_of_stream=end)))

    def response(self, status: int = 200, body: bytes = b"{}") -> None:
        self.send(ext_proc.ProcessingRequest(response_headers=_headers({":status": str(status)}, end_of_stream=False)))
        self.send(ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=body, end_of_stream=True)))

    def close(self) -> None:
        self._outbox.put_nowait(None)

    def cancel(self) -> None:
        self._call.cancel()


def _headers(pairs: dict[str, str], end_of_stream: bool) -> ext_proc.HttpHeaders:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end_of_stream)


def chat(content: str) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}).encode()


def destination(response: ext_proc.ProcessingResponse, common: ext_proc.CommonResponse) -> str:
    """The endpoint a picker's answer names, checked to agree in header and metadata."""
    [header] = [h.header for h in common.header_mutation.set_headers if h.header.key == DESTINATION_HEADER]
    assert common.clear_route_cache
    named = header.raw_value.decode()
    assert (
        response.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value
        == named
    )
    return named


async def active_requests(router: str) -> int:
    async with grpc.aio.insecure_channel(router) as channel:
        status = await router_pb2_grpc.RouterStub(channel).GetStatus(router_pb2.RouterStatusRequest(), timeout=5)
    return status.active_requests


@contextlib.asynccontextmanager
async def mesh(nats_url: str, nc: NatsClient, endpoints: tuple[str | None, ...]):
    """Indexer, router, one worker per entry (advertising that gateway endpoint, or none) and a frontend
    whose picker listens; yields the picker's stub and the router's address."""
    common = ["--nats-url", nats_url, "--namespace", NAMESPACE]
    picker_port = free_port()
    frontend = service_config(
        FrontendConfig, [*common, "--http-port", str(free_port()), "--ext-proc-port", str(picker_port)]
    )
    workers = [service_config(WorkerConfig, [*common, *(["--gateway-endpoint", e] if e else [])]) for e in endpoints]
    routers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "router")
    registered = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "worker")
    await routers.start()
    await registered.start()
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(
            running(indexer_server.serve, service_config(IndexerConfig, [*common, "--replica-id", "p"]))
        )
        for config in workers:
            await stack.enter_async_context(running(worker_server.serve, config))
        await stack.enter_async_context(running(router_server.serve, service_config(RouterConfig, common)))
        await stack.enter_async_context(running(frontend_server.serve, frontend))
        await wait_until_async(
            lambda: len(routers.instances()) == 1 and len(registered.instances()) == len(endpoints),
            timeout=30,
            what="mesh up",
        )
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{picker_port}"))
        await asyncio.wait_for(channel.channel_ready(), timeout=30)
        yield ext_proc_grpc.ExternalProcessorStub(channel), routers.instances()[0].address
    await routers.stop()
    await registered.stop()


async def test_the_picker_names_a_worker_routes_by_cache_and_frees_the_load_at_the_end(nats_url: str, nc: NatsClient):
    async with mesh(nats_url, nc, ENDPOINTS) as (stub, router):
        # buffered body: the headers pass at once, the destination rides on the body's answer
        gateway = Gateway(stub)
        gateway.headers(**{"x-request-id": "buffered-1"})
        assert (await gateway.receive()).HasField("request_headers")
        prompt = "the same long system prompt, " * 20
        gateway.body(chat(prompt + "first question"))
        answer = await gateway.receive()
        assert answer.HasField("request_body")
        first = destination(answer, answer.request_body.response)
        assert first in ENDPOINTS
        await wait_until_async(lambda: _active(router, 1), what="the router counts the request")
        gateway.response(200, b'{"choices": []}')
        assert (await gateway.receive()).HasField("response_headers")
        assert (await gateway.receive()).HasField("response_body")
        gateway.close()
        await wait_until_async(lambda: _active(router, 0), what="the end frees the load")

        # full duplex (the extension's default): the headers' answer waits for the body and names the
        # worker; the body comes back unchanged. The same prefix goes where its cache is.
        gateway = Gateway(stub)
        gateway.headers(mode=FULL_DUPLEX, **{"x-request-id": "duplex-1"})
        data = chat(prompt + "second question")
        gateway.body(data[:40], end=False)
        gateway.body(data[40:], end=True)
        headers_answer = await gateway.receive()
        assert headers_answer.HasField("request_headers")
        assert destination(headers_answer, headers_answer.request_headers.response) == first
        body_answer = await gateway.receive()
        streamed = body_answer.request_body.response.body_mutation.streamed_response
        assert streamed.body == data and streamed.end_of_stream
        # the response, streamed back in full duplex too: each chunk handed back as it came
        gateway.send(ext_proc.ProcessingRequest(response_headers=_headers({":status": "200"}, False)))
        assert (await gateway.receive()).HasField("response_headers")
        for chunk, end in ((b"data: 1\n\n", False), (b"data: [DONE]\n\n", True)):
            gateway.send(ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=chunk, end_of_stream=end)))
            echoed = (await gateway.receive()).response_body.response.body_mutation.streamed_response
            assert (echoed.body, echoed.end_of_stream) == (chunk, end)
        gateway.close()
        await wait_until_async(lambda: _active(router, 0), what="the streamed end frees the load")

        # a client that goes away mid-answer: the gateway cancels the stream, the load is freed
        gateway = Gateway(stub)
        gateway.headers(mode=BUFFERED)
        assert (await gateway.receive()).HasField("request_headers")
        gateway.body(chat("a question nobody waits for"))
        assert (await gateway.receive()).HasField("request_body")
        await wait_until_async(lambda: _active(router, 1), what="counted")
        gateway.cancel()
        await wait_until_async(lambda: _active(router, 0), what="a cancelled exchange frees the load")


async def _active(router: str, count: int) -> bool:
    return await active_requests(router) == count


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        (
            "/v1/chat/completions",
            json.dumps({"model": "other", "messages": [{"role": "user", "content": "x"}]}).encode(),
            404,
            "other",
        ),
        ("/v1/embeddings", chat("x"), 404, "/v1/embeddings"),
        # checked as the HTTP API checks them: a session id too long to keep
        (
            "/v1/chat/completions",
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "user": "u" * 300}).encode(),
            400,
            "user: a session id is at most 256 characters",
        ),
    ],
)
async def test_a_request_the_picker_cannot_route_gets_an_openai_error_at_once(
    nats_url: str, nc: NatsClient, path: str, body: bytes, status: int, says: str
):
    async with mesh(nats_url, nc, ENDPOINTS[:1]) as (stub, router):
        gateway = Gateway(stub)
        gateway.headers(path=path)
        assert (await gateway.receive()).HasField("request_headers")
        gateway.body(body)
        immediate = (await gateway.receive()).immediate_response
        assert immediate.status.code == status
        assert says in json.loads(immediate.body)["error"]["message"]
        gateway.close()
        assert await active_requests(router) == 0  # nothing was routed


async def test_a_worker_without_a_gateway_endpoint_is_a_503_and_frees_what_was_counted(nats_url: str, nc: NatsClient):
    async with mesh(nats_url, nc, (None,)) as (stub, router):
        gateway = Gateway(stub)
        gateway.headers(mode=FULL_DUPLEX)
        gateway.body(chat("hello"))
        immediate = (await gateway.receive()).immediate_response
        assert immediate.status.code == 503
        assert "--gateway-endpoint" in json.loads(immediate.body)["error"]["message"]
        assert any(h.header.key == "retry-after" for h in immediate.headers.set_headers)
        gateway.close()
        await wait_until_async(lambda: _active(router, 0), what="the refused request's load freed")


async def test_a_streamed_body_mode_is_refused_saying_which_modes_work(nats_url: str, nc: NatsClient):
    async with mesh(nats_url, nc, ENDPOINTS[:1]) as (stub, _router):
        gateway = Gateway(stub)
        gateway.headers(mode=processing_mode_pb2.ProcessingMode.BodySendMode.STREAMED)
        immediate = (await gateway.receive()).immediate_response
        assert immediate.status.code == 500 and b"FULL_DUPLEX_STREAMED" in immediate.body
        gateway.close()
