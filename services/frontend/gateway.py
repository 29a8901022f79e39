"""The frontend's core: turns an OpenAI request into a router call and the router's token stream
into text pieces, with usage accounting and router failover."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvmesh.common.finish_reasons import finish_name
from kvmesh.common.grpc_errors import is_transport_failure
from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.requests import continue_request
from kvmesh.frontend.direct_path import DirectTokenPath
from kvmesh.frontend.errors import (
    BadRequestError,
    ModelNotFoundError,
    OpenAIError,
    ServiceUnavailableError,
    UpstreamError,
)
from kvmesh.frontend.load_window import LoadWindow
from kvmesh.frontend.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.frontend.router_client import NoRouterError, RouterClient
from kvmesh.frontend.tokenizer import IncrementalDetokenizer, ModelTokenizer, StopStringMatcher

log = structlog.get_logger(__name__)

_GRPC_TO_HTTP: dict[grpc.StatusCode, type[OpenAIError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: BadRequestError,
    grpc.StatusCode.OUT_OF_RANGE: BadRequestError,
    grpc.StatusCode.NOT_FOUND: BadRequestError,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ServiceUnavailableError,
}


WORKER_ID_HEADER = "x-kvmesh-worker-id"
# Router replicas one request may fail over to after the first.
ROUTER_FAILOVER_LIMIT = 3


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: ModelTokenizer
    created: int


@dataclass
class Piece:
    """A piece of an answer: new text, and on the last piece the finish reason."""

    text: str
    finish_reason: str | None = None


@dataclass
class UsageCounter:
    """Token accounting of one request, and the worker that served it."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker_id: int | None = None

    def body(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvmesh_frontend_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvmesh_frontend_time_to_first_token_seconds", "time to first token", registry=self.registry
        )
        self.latency = Histogram(
            "kvmesh_frontend_request_duration_seconds", "whole request duration", registry=self.registry
        )
        self.cached_tokens = Counter(
            "kvmesh_frontend_cached_prompt_tokens",
            "prompt tokens served from KV cache",
            registry=self.registry,
        )
        self.prompt_tokens = Counter("kvmesh_frontend_prompt_tokens", "prompt tokens", registry=self.registry)


class Frontend:
    """Turns OpenAI requests into router calls and router streams into OpenAI responses."""

    def __init__(
        self,
        model: ServedModel,
        routers: RouterClient,
        default_max_tokens: int = 64,
        direct: DirectTokenPath | None = None,
    ) -> None:
        """``direct``: stream answers straight from the workers (``--token-path direct``); without
        it the router replicas relay them."""
        self.model = model
        self.routers = routers
        self.direct = direct
        self.default_max_tokens = default_max_tokens
        self.metrics = FrontendMetrics()
        self.load = LoadWindow(f"frontend-{uuid.uuid4().hex[:8]}")

    def check_model(self, name: str) -> None:
        if name != self.model.name:
            raise ModelNotFoundError(name)

    def check_context(self, prompt_tokens: int, max_tokens: int | None) -> None:
        """A 400, as vLLM answers, when the prompt plus the tokens asked for exceed the model's context."""
        limit = self.model.tokenizer.max_length
        wanted = prompt_tokens + (max_tokens or 0)
        if limit is not None and wanted > limit:
            raise BadRequestError(
                f"this model's maximum context length is {limit} tokens; the prompt has {prompt_tokens} tokens "
                f"and max_tokens asks for {max_tokens or 0} more ({wanted})",
                param="max_tokens" if prompt_tokens <= limit else "prompt",
            )

    def build_request(
        self, request_id: str, body: ChatCompletionRequest | CompletionRequest, token_ids: list[int]
    ) -> common_pb2.PreprocessedRequest:
        max_tokens = body.requested_max_tokens() or self.default_max_tokens
        request = common_pb2.PreprocessedRequest(request_id=request_id, model=body.model, token_ids=token_ids)
        request.stop.max_tokens = max_tokens
        eos = self.model.tokenizer.eos_token_id
        request.stop.ignore_eos = body.ignore_eos
        if eos is not None and not body.ignore_eos:
            request.stop.stop_token_ids.append(eos)
        if body.temperature is not None:
            request.sampling.temperature = body.temperature
        if body.top_p is not None:
            request.sampling.top_p = body.top_p
        if body.seed is not None:
            request.sampling.seed = body.seed & 0xFFFFFFFFFFFFFFFF
        if body.kvmesh is not None:
            if body.kvmesh.worker_id is not None:
                request.routing.worker_id = body.kvmesh.worker_id
            if body.kvmesh.expected_output_tokens is not None:
                request.expected_output_tokens = body.kvmesh.expected_output_tokens
            override = body.kvmesh.router_config_override
            if override is not None:
                if override.overlap_score_weight is not None:
                    request.routing.router_config_override.overlap_score_weight = override.overlap_score_weight
                if override.router_temperature is not None:
                    request.routing.router_config_override.router_temperature = override.router_temperature
                for expert in override.moe_query or ():
                    request.routing.router_config_override.moe_query.add(layer=expert.layer, expert=expert.expert)
        return request

    async def generate(
        self, request: common_pb2.PreprocessedRequest, stop: list[str], usage: UsageCounter, whole: bool = False
    ) -> AsyncIterator[Piece]:
        """Stream text pieces; stop strings end the answer early (finish reason ``stop``).

        ``whole`` (an answer sent whole, with no stop strings to watch for): the worker holds the
        outputs after the first until the last (``whole_answer``), which saves a message per output
        through every hop; the first still comes at once, for time to first token and the router's
        load picture (docs/decisions/0026).

        A router replica that dies (transport failure, not a deliberate refusal) is replaced by
        another one, which continues from the tokens already streamed: the client sees one answer.
        """
        request.whole_answer = whole
        detokenizer = IncrementalDetokenizer(self.model.tokenizer)
        matcher = StopStringMatcher(stop)
        max_tokens = request.stop.max_tokens
        generated: list[int] = []
        failed: set[str] = set()
        for attempt in range(ROUTER_FAILOVER_LIMIT + 1):
            try:
                address = self.routers.pick(frozenset(failed))
            except NoRouterError as exc:
                raise ServiceUnavailableError(str(exc)) from exc
            sent = request if attempt == 0 else continue_request(request, generated, max_tokens, f"r{attempt}")
            try:
                # closing the stream when we stop early cancels the request: that frees its worker
                if self.direct is not None:
                    stream = self.direct.generate(sent, address)
                else:
                    stream = self.routers.generate(sent, address)
                async with contextlib.aclosing(stream) as outputs:
                    async for output in outputs:
                        generated.extend(output.token_ids)
                        usage.completion_tokens = len(generated)
                        usage.worker_id = output.worker_id
                        if attempt == 0 and output.usage.cached_prompt_tokens:
                            usage.cached_tokens = output.usage.cached_prompt_tokens
                        text, stopped = matcher.feed(detokenizer.add(output.token_ids))
                        if stopped:
                            yield Piece(text, "stop")
                            return
                        if output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                            yield Piece(text + matcher.flush(), finish_name(output.finish_reason, "stop"))
                            return
                        if text:
                            yield Piece(text)
            except grpc.aio.AioRpcError as exc:
                if not is_transport_failure(exc):
                    raise _map_grpc_error(exc) from exc
                failed.add(address)
                log.warning(
                    "router replica failed; continuing on another",
                    router=address,
                    tokens_so_far=len(generated),
                    code=exc.code().name,
                )
                if generated and len(generated) >= max_tokens:
                    yield Piece(matcher.flush(), "length")
                    return
                continue
            raise UpstreamError("the router stream ended without a finish reason")
        raise ServiceUnavailableError(f"router replicas failed {ROUTER_FAILOVER_LIMIT + 1} times for this request")


def _map_grpc_error(exc: grpc.aio.AioRpcError) -> OpenAIError:
    error_class = _GRPC_TO_HTTP.get(exc.code(), UpstreamError)
    return error_class(exc.details() or exc.code().name)
