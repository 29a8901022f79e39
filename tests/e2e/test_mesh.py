"""End to end over ``kvmesh up``'s processes, with the official openai client and generated gRPC stubs."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import grpc
import httpx
import nats
import openai
import pytest

from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.wire.request_reports import END, RequestReport, encode_reports
from tests.e2e.conftest import chat
from tests.support import discovered, metric_samples, wait_until_async

pytestmark = pytest.mark.e2e
MODEL = "kvmesh-tiny"
BLOCK = 16
# Long enough for at least 8 full blocks of 16 tokens with the byte-level tokenizer.
LONG_PROMPT = "Explain how a KV-cache aware router decides where to send a request. " * 3


def client(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=30)


def test_non_streaming_chat(kv_mesh):
    completion, _worker = chat(kv_mesh, "hello", max_tokens=7)
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert len(choice.message.content) == 7  # one byte-level token per character
    assert completion.usage.completion_tokens == 7
    # ChatML: three special tokens plus one byte-level token per character of the rest
    assert completion.usage.prompt_tokens == 3 + len("user\nhello\nassistant\n")


def test_streaming_chat_with_usage(kv_mesh):
    stream = client(kv_mesh).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(text) == 9 and finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_completions_endpoint_streaming_and_not(kv_mesh):
    api = client(kv_mesh)
    whole = api.completions.create(model=MODEL, prompt="once upon a time", max_tokens=6, seed=3)
    parts = api.completions.create(model=MODEL, prompt="once upon a time", max_tokens=6, seed=3, stream=True)
    streamed = "".join(p.choices[0].text for p in parts)
    assert streamed == whole.choices[0].text and len(streamed) == 6  # deterministic for a seed


def test_stop_string_ends_the_answer(kv_mesh):
    api = client(kv_mesh)
    full = api.completions.create(model=MODEL, prompt="stop test", max_tokens=40, seed=11).choices[0].text
    stop = full[10:12]
    cut = api.completions.create(model=MODEL, prompt="stop test", max_tokens=40, seed=11, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]


def test_same_long_prompt_lands_on_the_same_worker_and_reuses_its_cache(kv_mesh):
    first, first_worker = chat(kv_mesh, LONG_PROMPT, max_tokens=4)
    assert first.usage.prompt_tokens >= 8 * BLOCK

    async def second_until_indexed():
        # the first request's KV events travel worker → JetStream → indexer; wait for them, not a sleep
        for _ in range(100):
            second, worker = await asyncio.to_thread(chat, kv_mesh, LONG_PROMPT, max_tokens=4)
            if second.usage.prompt_tokens_details.cached_tokens >= 8 * BLOCK:
                return second, worker
            await asyncio.sleep(0.05)
        raise AssertionError("the repeated prompt never reported cached tokens")

    second, second_worker = asyncio.run(second_until_indexed())
    assert second_worker == first_worker
    assert second.usage.prompt_tokens_details.cached_tokens >= 8 * BLOCK


def forwards(mesh) -> dict[str, float]:
    """The router's kvmesh_router_forwards_total samples by result."""
    address = discovered(mesh.nats_url, "router")[0].extra["metrics"]
    counts = dict.fromkeys(("sent", "refused", "lost"), 0.0)
    counts |= {labels["result"]: value for labels, value in metric_samples(address, "kvmesh_router_forwards_total")}
    return counts


def test_the_router_hands_requests_on_to_their_workers(kv_mesh):
    """The router sends each request on to its worker; only the first to a worker the frontend has
    no stream to yet is refused there, and the frontend submits that one itself."""
    before = forwards(kv_mesh)
    for i in range(4):  # two workers: one of them gets a second request, after its stream is attached
        answer, _ = chat(kv_mesh, f"forward {i}: " + LONG_PROMPT, max_tokens=3)
        assert answer.usage.completion_tokens == 3
    after = forwards(kv_mesh)
    sent, refused = after["sent"] - before["sent"], after["refused"] - before["refused"]
    # each try is sent on (the very first to a router goes the usual way: its migration limit is
    # not known yet); at most one per worker is refused, so at least one ran as handed on
    assert 3 <= sent <= 4 and refused <= 2 and sent - refused >= 1
    assert after["lost"] == before["lost"]


def test_round_robin_sends_the_pair_to_different_workers(round_robin_mesh):
    _, first = chat(round_robin_mesh, LONG_PROMPT, max_tokens=2)
    second, second_worker = chat(round_robin_mesh, LONG_PROMPT, max_tokens=2)
    assert first != second_worker
    assert second.usage.prompt_tokens_details.cached_tokens == 0


def test_openai_errors(kv_mesh):
    api = client(kv_mesh)
    with pytest.raises(openai.NotFoundError) as not_found:
        api.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
    raw = httpx.post(f"{kv_mesh.api}/chat/completions", content=b"{broken", timeout=10)
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert api.models.list().data[0].id == MODEL
    assert httpx.get(f"{kv_mesh.base_url}/health", timeout=10).status_code == 200
    assert "kvmesh_frontend_requests" in httpx.get(f"{kv_mesh.base_url}/metrics", timeout=10).text


def test_an_idle_connection_outlasts_the_clients_keep_alive_expiry(kv_mesh):
    """httpx reuses a connection idle up to its keep-alive expiry; the frontend must not close it
    first, or the request sent on it fails with a connection error."""
    url = httpx.URL(kv_mesh.base_url)
    request = f"GET /health HTTP/1.1\r\nHost: {url.host}\r\n\r\n".encode()

    def response(conn: socket.socket) -> bytes:
        """One whole response: its head, then as much body as its Content-Length says (a recv may
        return the head alone, leaving the body to be mistaken for the next response)."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(4096)
            assert chunk, f"the connection closed after {data!r}"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            chunk = conn.recv(4096)
            assert chunk, "the connection closed mid-body"
            body += chunk
        return head

    with socket.create_connection((url.host, url.port), timeout=10) as conn:
        conn.sendall(request)
        assert response(conn).startswith(b"HTTP/1.1 200")
        # the idle time is what is tested here, not a wait for something to happen
        time.sleep((httpx.Limits().keepalive_expiry or 5.0) + 1.0)
        conn.sendall(request)
        assert response(conn).startswith(b"HTTP/1.1 200")


def test_the_request_path_over_grpc_with_generated_stubs(kv_mesh):
    """What an external gRPC client does: Router.Route, Worker.Generate on the worker it names, and the
    end reported on a RouteMany stream; a bad request is refused with INVALID_ARGUMENT."""

    async def call() -> list[common_pb2.GenerateOutput]:
        async with first_router(kv_mesh.nats_url) as (router, worker_addresses):
            before = await active_requests(router)
            request = common_pb2.PreprocessedRequest(request_id="stubs", model=MODEL, token_ids=list(range(60)))
            request.stop.max_tokens = 5
            query = router_pb2.RouteRequest()
            query.request.CopyFrom(request)
            route = await router.Route(query)
            assert route.worker_address in worker_addresses
            request.disaggregated_params = route.disaggregated_params
            async with grpc.aio.insecure_channel(route.worker_address) as channel:
                outputs = [o async for o in worker_pb2_grpc.WorkerStub(channel).Generate(request)]
            reports = router.RouteMany()
            ended = encode_reports([RequestReport(END, "stubs", "completed", len(outputs))])
            await reports.write(router_pb2.RouteQueries(reports=ended))
            await wait_until_async(lambda: _equals(active_requests(router), before), what="the end applied")
            reports.cancel()
            empty = router_pb2.RouteRequest(request=common_pb2.PreprocessedRequest(request_id="empty", model=MODEL))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await router.Route(empty)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            return outputs

    outputs = asyncio.run(call())
    assert sum(len(o.token_ids) for o in outputs) == 5
    assert outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def _equals(pending, expected) -> bool:
    return (await pending) == expected


@contextlib.asynccontextmanager
async def first_router(nats_url: str) -> AsyncIterator[tuple[router_pb2_grpc.RouterStub, set[str]]]:
    """A stub for the mesh's first router replica, and the addresses of its workers."""
    nc = await nats.connect(nats_url)
    routers = DiscoveryWatcher(nc.jetstream(), "default", "router")
    workers = DiscoveryWatcher(nc.jetstream(), "default", "worker")
    await routers.start()
    await workers.start()
    try:
        async with grpc.aio.insecure_channel(routers.instances()[0].address) as channel:
            yield router_pb2_grpc.RouterStub(channel), {w.address for w in workers.instances()}
    finally:
        await routers.stop()
        await workers.stop()
        await nc.close()


async def active_requests(router: router_pb2_grpc.RouterStub) -> int:
    return (await router.GetStatus(router_pb2.RouterStatusRequest())).active_requests


def test_route_many_answers_each_query_as_route_would(kv_mesh):
    """``Router.RouteMany`` (the stream the request path routes over): a message's
    queries each get Route's answer or refusal, by query id, and the stream goes on after a refusal."""

    def query(query_id: int, request_id: str, tokens: list[int]) -> router_pb2.RouteQuery:
        request = common_pb2.PreprocessedRequest(request_id=request_id, model=MODEL, token_ids=tokens)
        return router_pb2.RouteQuery(query_id=query_id, request=router_pb2.RouteRequest(request=request))

    async def answers_to(stream, *queries: router_pb2.RouteQuery) -> dict[int, router_pb2.RouteAnswer]:
        await stream.write(router_pb2.RouteQueries(queries=queries))
        answers: dict[int, router_pb2.RouteAnswer] = {}
        while len(answers) < len(queries):  # each is sent once decided: they may come apart
            answers.update((a.query_id, a) for a in (await stream.read()).answers)
        return answers

    async def call() -> None:
        async with first_router(kv_mesh.nats_url) as (router, worker_addresses):
            before = await active_requests(router)
            stream = router.RouteMany()
            first = await answers_to(
                stream, query(1, "many-a", [5] * 40), query(2, "many-b", [6] * 40), query(3, "many-c", [])
            )
            for routed in (first[1], first[2]):
                assert not routed.HasField("refused") and routed.response.worker_address in worker_addresses
            assert first[3].refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert first[3].refused.origin == "router" and "token_ids" in first[3].refused.details
            assert await active_requests(router) == before + 2
            again = await answers_to(stream, query(4, "many-a", [5] * 40))
            assert again[4].refused.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
            # a last query, then the caller closes its side: it is answered before the stream ends
            await stream.write(router_pb2.RouteQueries(queries=[query(5, "many-d", [])]))
            await stream.done_writing()
            last = []
            while (message := await asyncio.wait_for(stream.read(), timeout=30)) is not grpc.aio.EOF:
                last += [a.query_id for a in message.answers]
            assert last == [5]
            # the ends are reported on a stream too, as the request path does
            ends = [RequestReport(END, r, "completed", 1) for r in ("many-a", "many-b")]
            reports = router.RouteMany()
            await reports.write(router_pb2.RouteQueries(reports=encode_reports(ends)))

            async def freed() -> bool:
                return await active_requests(router) == before

            await wait_until_async(freed, what="the reported ends to free both requests")
            reports.cancel()

    asyncio.run(call())


def test_route_counts_a_request_until_its_end_is_reported(kv_mesh):
    """``Router.Route`` over gRPC, and its end reported on a ``RouteMany`` stream."""

    async def call() -> None:
        async with first_router(kv_mesh.nats_url) as (router, worker_addresses):
            before = await active_requests(router)
            query = router_pb2.RouteRequest(
                request=common_pb2.PreprocessedRequest(request_id="routed-e2e", model=MODEL, token_ids=[7] * 40)
            )
            route = await router.Route(query)
            assert route.worker_address in worker_addresses and not route.disaggregated_params
            assert route.migration_limit == 3 and not route.forced
            assert await active_requests(router) == before + 1
            with pytest.raises(grpc.aio.AioRpcError) as twice:
                await router.Route(query)
            assert twice.value.code() == grpc.StatusCode.ALREADY_EXISTS
            with pytest.raises(grpc.aio.AioRpcError) as empty:
                await router.Route(router_pb2.RouteRequest(request=common_pb2.PreprocessedRequest(request_id="e")))
            assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            reports = router.RouteMany()  # where a caller of Route reports how its requests go
            ended = encode_reports([RequestReport(END, "routed-e2e", "completed", 3)])
            await reports.write(router_pb2.RouteQueries(reports=ended))

            async def freed() -> bool:
                return await active_requests(router) == before

            await wait_until_async(freed, what="the reported end to free the request")
            await reports.done_writing()  # a caller that closes its side ends the stream
            assert await asyncio.wait_for(reports.read(), timeout=30) is grpc.aio.EOF

    asyncio.run(call())
