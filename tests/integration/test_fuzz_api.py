"""Fuzzing the mesh's two front doors with hypothesis, against real services (mock worker, router,
frontend on a real socket):

- HTTP: request bodies built from the OpenAI request fields (each field present or not, with a
  value of its own type, a value out of range, or any JSON at all), plus arbitrary JSON documents
  and bytes. Every answer is below 500: a 4xx with an OpenAI error body, or a valid completion
  (a stream ends with ``[DONE]`` and carries no error).
- gRPC ``Router.Generate``: requests with random token ids, sizes and fields. Every call ends with a
  finish reason or a status that blames the request (never UNKNOWN or INTERNAL).

Afterwards the mesh still serves. The model is the tiny one with its context cut to 512 tokens, so
every accepted request is short. Hypothesis runs in a thread while the services run on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections import Counter
from pathlib import Path

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient

from kvmesh.common.core.tiny_model import MODEL_NAME
from kvmesh.common.proto.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc
from kvmesh.common.runtime.discovery import DiscoveryWatcher
from kvmesh.common.wire.request_reports import END, RequestReport, encode_reports
from kvmesh.frontend import server as frontend_server
from kvmesh.frontend.config import FrontendConfig
from kvmesh.router import server as router_server
from kvmesh.router.config import RouterConfig
from kvmesh.worker import server as worker_server
from kvmesh.worker.config import WorkerConfig
from tests.support import free_port, running, service_config, small_context_model, wait_until_async

pytestmark = pytest.mark.integration
NAMESPACE = "fuzz"
CONTEXT = 512
HTTP_EXAMPLES = 600
GRPC_EXAMPLES = 200


def fuzz_settings(examples: int) -> settings:
    """Deterministic (the same examples every run: CI must not find a new case by chance), no
    example database, no per-example deadline (a real mesh answers each)."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        print_blob=True,
    )


# ---- HTTP bodies ---------------------------------------------------------------------------------
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
any_json = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
)
small_ints = st.integers(min_value=-5, max_value=600)
huge_ints = st.integers(min_value=2**31, max_value=2**70) | st.integers(max_value=-(2**31), min_value=-(2**70))


def mostly(usual: st.SearchStrategy, rare: st.SearchStrategy, one_in: int) -> st.SearchStrategy:
    """``usual``, except one draw in ``one_in`` (about) from ``rare``: keeps most requests valid
    enough to go all the way through the mesh while still trying the odd ones."""
    return st.integers(1, one_in).flatmap(lambda roll: rare if roll == 1 else usual)


some_int = mostly(st.integers(min_value=1, max_value=64), small_ints | huge_ints, 8)
some_float = st.one_of(
    *[st.floats(min_value=0, max_value=1)] * 4,
    st.floats(allow_nan=False, allow_infinity=False, min_value=-10, max_value=10),
)
content = st.text(max_size=60) | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": st.text(max_size=30)}),
    max_size=3,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "user", "assistant", "tool", "robot", ""]), "content": content}
)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly one of its own kind, sometimes any JSON at all."""
    return mostly(valid, any_json, 20)


sampling_fields = {
    "model": field(st.sampled_from([MODEL_NAME, MODEL_NAME, "another-model", ""])),
    "max_tokens": field(some_int),
    "temperature": field(some_float),
    "top_p": field(some_float),
    "n": field(mostly(st.just(1), small_ints, 6)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "stop": field(st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=6)),
    "seed": field(some_int),
    "ignore_eos": field(st.booleans()),
    "kvmesh": field(
        st.fixed_dictionaries(
            {},
            optional={
                "worker_id": some_int,
                "expected_output_tokens": some_int,
                "router_config_override": st.fixed_dictionaries(
                    {}, optional={"overlap_score_weight": some_float, "router_temperature": some_float}
                ),
            },
        )
    ),
}
chat_bodies = st.fixed_dictionaries(
    {"model": sampling_fields["model"], "messages": field(st.lists(message, max_size=4))},
    optional={
        **{k: v for k, v in sampling_fields.items() if k != "model"},
        "max_completion_tokens": field(some_int),
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.one_of(st.just(0), small_ints)),
    },
)
completion_bodies = st.fixed_dictionaries(
    {"model": sampling_fields["model"], "prompt": field(st.text(max_size=80) | st.lists(some_int, max_size=40))},
    optional={
        **{k: v for k, v in sampling_fields.items() if k != "model"},
        "echo": field(st.booleans()),
        "best_of": field(st.one_of(st.just(1), small_ints)),
        "suffix": field(st.one_of(st.none(), st.text(max_size=5))),
        "logprobs": field(st.one_of(st.none(), small_ints)),
    },
)
ENDPOINTS = ["/v1/chat/completions", "/v1/completions"]
http_requests = mostly(
    st.tuples(st.just(ENDPOINTS[0]), chat_bodies.map(json.dumps))
    | st.tuples(st.just(ENDPOINTS[1]), completion_bodies.map(json.dumps)),
    st.tuples(st.sampled_from(ENDPOINTS), any_json.map(json.dumps) | st.binary(max_size=40).map(repr)),
    4,
)


def check_http_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"]
        return
    assert response.status_code == 200
    if response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in response.text, response.text
    else:
        assert response.json()["choices"]


# ---- gRPC requests -------------------------------------------------------------------------------
uint32 = st.integers(min_value=0, max_value=2**32 - 1)
any_float = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def router_requests(draw) -> common_pb2.PreprocessedRequest:
    request = common_pb2.PreprocessedRequest(
        request_id=draw(st.text(max_size=20)),
        model=draw(st.sampled_from(["", MODEL_NAME, "other"])),
        token_ids=draw(st.lists(st.one_of(st.integers(0, 300), uint32), max_size=200)),
    )
    request.stop.max_tokens = draw(st.integers(0, 40))
    request.stop.ignore_eos = draw(st.booleans())
    request.stop.stop_token_ids.extend(draw(st.lists(uint32, max_size=3)))
    if draw(st.booleans()):
        request.sampling.temperature = draw(any_float)
    if draw(st.booleans()):
        request.sampling.top_p = draw(any_float)
    if draw(st.booleans()):
        request.sampling.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        request.routing.worker_id = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        request.expected_output_tokens = draw(uint32)
    return request


# Statuses that say the request was at fault or could not be served now; UNKNOWN and INTERNAL would
# be the mesh failing on it.
REQUEST_STATUSES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


async def test_fuzzed_http_and_grpc_requests_never_break_the_mesh(nats_url: str, nc: NatsClient, tmp_path: Path):
    port = free_port()
    common = ["--nats-url", nats_url, "--namespace", NAMESPACE]
    frontend_args = [*common, "--http-port", str(port), "--model-path", str(small_context_model(tmp_path, CONTEXT))]
    routers = DiscoveryWatcher(nc.jetstream(), NAMESPACE, "router")
    await routers.start()
    async with (
        running(worker_server.serve, service_config(WorkerConfig, [*common, "--speedup-ratio", "200"])),
        running(router_server.serve, service_config(RouterConfig, common)),
        running(frontend_server.serve, service_config(FrontendConfig, frontend_args)),
    ):
        base = f"http://127.0.0.1:{port}"

        async def serving() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                async with httpx.AsyncClient() as http:
                    return (await http.get(f"{base}/health", timeout=2)).status_code == 200
            return False

        await wait_until_async(serving, timeout=20, what="the mesh serving")
        await wait_until_async(lambda: routers.instances(), what="the router registered")
        router_address = routers.instances()[0].address
        http_statuses: Counter[int] = Counter()
        error_params: Counter[str | None] = Counter()
        grpc_outcomes: Counter[str] = Counter()

        def fuzz_http() -> None:
            with httpx.Client(base_url=base, timeout=30) as http:

                @fuzz_settings(HTTP_EXAMPLES)
                @given(http_requests)
                def one(path_and_body: tuple[str, str]) -> None:
                    path, body = path_and_body
                    response = http.post(path, content=body, headers={"content-type": "application/json"})
                    http_statuses[response.status_code] += 1
                    if response.status_code == 400:
                        error_params[response.json()["error"]["param"]] += 1
                    check_http_answer(response)

                one()

        def fuzz_grpc() -> None:
            # the gRPC surface of the request path: Router.Route, then Worker.Generate on the worker it
            # names (with the parameters of a split request), and the end reported on RouteMany
            with grpc.insecure_channel(router_address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)

                @fuzz_settings(GRPC_EXAMPLES)
                @given(router_requests())
                def one(request: common_pb2.PreprocessedRequest) -> None:
                    # the mock engine has no context limit: keep every request it accepts short
                    request.stop.max_tokens = min(request.stop.max_tokens, 40)
                    query = router_pb2.RouteRequest()
                    query.request.CopyFrom(request)
                    try:
                        route = stub.Route(query, timeout=30)
                        sent = common_pb2.PreprocessedRequest()
                        sent.CopyFrom(request)
                        sent.disaggregated_params = route.disaggregated_params
                        with grpc.insecure_channel(route.worker_address) as worker_channel:
                            outputs = list(worker_pb2_grpc.WorkerStub(worker_channel).Generate(sent, timeout=30))
                    except grpc.RpcError as exc:
                        grpc_outcomes[exc.code().name] += 1
                        # no worker serves a model of that name: nothing is wrong with the mesh
                        unserved_model = request.model not in ("", MODEL_NAME)
                        if unserved_model and exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
                            return
                        assert exc.code() in REQUEST_STATUSES, f"{exc.code().name}: {exc.details()}"
                        return
                    finally:
                        ended = RequestReport(END, request.request_id, "completed")
                        list(stub.RouteMany(iter([router_pb2.RouteQueries(reports=encode_reports([ended]))])))
                    grpc_outcomes["OK"] += 1
                    assert outputs and outputs[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    assert not math.isnan(sum(len(o.token_ids) for o in outputs))

                one()

        await asyncio.to_thread(fuzz_http)
        await asyncio.to_thread(fuzz_grpc)
        print(f"\nHTTP fuzz: {sum(http_statuses.values())} requests, statuses {dict(sorted(http_statuses.items()))}")
        print(f"HTTP 400s by field: {error_params.most_common(8)}")
        print(f"gRPC fuzz: {sum(grpc_outcomes.values())} calls, outcomes {dict(sorted(grpc_outcomes.items()))}")
        assert http_statuses[200] > 0 and sum(n for s, n in http_statuses.items() if 400 <= s < 500) > 0
        assert grpc_outcomes["OK"] > 0

        async with httpx.AsyncClient(base_url=base, timeout=30) as http:  # still serving
            body = {"model": MODEL_NAME, "prompt": "still there?", "max_tokens": 5}
            answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
    await routers.stop()
