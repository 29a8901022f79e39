"""The OpenAI-compatible HTTP facade: validation, chat template, tokenisation, streaming, usage."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ValidationError

from kvmesh.common.grpc_errors import is_transport_failure
from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.requests import continue_request
from kvmesh.frontend.errors import (
    BadRequestError,
    ModelNotFoundError,
    OpenAIError,
    ServiceUnavailableError,
    UpstreamError,
)
from kvmesh.frontend.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.frontend.router_client import NoRouterError, RouterClient
from kvmesh.frontend.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    ModelTokenizer,
    StopStringMatcher,
)

log = structlog.get_logger(__name__)

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_ERROR: "error",
}
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
    ) -> None:
        self.model = model
        self.routers = routers
        self.default_max_tokens = default_max_tokens
        self.metrics = FrontendMetrics()

    def check_model(self, name: str) -> None:
        if name != self.model.name:
            raise ModelNotFoundError(name)

    def build_request(
        self, request_id: str, body: ChatCompletionRequest | CompletionRequest, token_ids: list[int]
    ) -> common_pb2.PreprocessedRequest:
        max_tokens = body.requested_max_tokens() or self.default_max_tokens
        request = common_pb2.PreprocessedRequest(request_id=request_id, model=body.model, token_ids=token_ids)
        request.stop.max_tokens = max_tokens
        eos = self.model.tokenizer.eos_token_id
        if eos is not None:
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
        return request

    async def generate(
        self, request: common_pb2.PreprocessedRequest, stop: list[str], usage: UsageCounter
    ) -> AsyncIterator[Piece]:
        """Stream text pieces; stop strings end the answer early (finish reason ``stop``).

        A router replica that dies (transport failure, not a deliberate refusal) is replaced by
        another one, which continues from the tokens already streamed: the client sees one answer.
        """
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
            call = self.routers.generate(sent, address)
            try:
                async for output in call:
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
                        yield Piece(text + matcher.flush(), _FINISH_REASONS.get(output.finish_reason, "stop"))
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
            finally:
                call.cancel()  # no-op when the stream ended; frees the worker when we stopped early
            raise UpstreamError("the router stream ended without a finish reason")
        raise ServiceUnavailableError(f"router replicas failed {ROUTER_FAILOVER_LIMIT + 1} times for this request")


def _map_grpc_error(exc: grpc.aio.AioRpcError) -> OpenAIError:
    error_class = _GRPC_TO_HTTP.get(exc.code(), UpstreamError)
    return error_class(exc.details() or exc.code().name)


BodyT = TypeVar("BodyT", bound=BaseModel)


def parse_body(model: type[BodyT], raw: bytes) -> BodyT:
    """Parse a JSON request body whatever its Content-Type; any problem is a 400 naming the field."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequestError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        param = None
        for err in exc.errors():
            location = ".".join(str(p) for p in err.get("loc", ()))
            param = param or location or None
            problems.append(f"{location or 'body'}: {err.get('msg')}")
        raise BadRequestError("; ".join(problems), param=param) from exc


def _sse(payload: object) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def create_app(frontend: Frontend) -> FastAPI:
    app = FastAPI(title="kvmesh", docs_url=None, redoc_url=None)
    metrics = frontend.metrics

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable) -> Response:
        response = await call_next(request)
        metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health() -> JSONResponse:
        routers = len(frontend.routers.addresses())
        status = 200 if routers > 0 else 503
        return JSONResponse(
            {"status": "healthy" if status == 200 else "no router", "routers": routers}, status_code=status
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict[str, object]:
        model = frontend.model
        return {
            "object": "list",
            "data": [{"id": model.name, "object": "model", "created": model.created, "owned_by": "kvmesh"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await request.body())
        frontend.check_model(body.model)
        try:
            prompt = frontend.model.tokenizer.apply_chat_template(body.template_messages())
        except ChatTemplateError as exc:
            raise BadRequestError(str(exc), param="messages") from exc
        token_ids = frontend.model.tokenizer.encode(prompt)
        return await _respond(frontend, body, token_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(CompletionRequest, await request.body())
        frontend.check_model(body.model)
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise BadRequestError("prompt is empty", param="prompt")
            token_ids = frontend.model.tokenizer.encode(body.prompt)
        else:
            vocab = frontend.model.tokenizer.vocab_size
            if any(t >= vocab for t in body.prompt):
                raise BadRequestError(f"prompt token ids must be below the vocabulary size {vocab}", param="prompt")
            token_ids = list(body.prompt)
        return await _respond(frontend, body, token_ids, chat=False)

    return app


async def _respond(
    frontend: Frontend, body: ChatCompletionRequest | CompletionRequest, token_ids: list[int], chat: bool
) -> Response:
    prefix = "chatcmpl" if chat else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    structlog.contextvars.bind_contextvars(request_id=request_id)
    started = time.monotonic()
    created = int(time.time())
    usage = UsageCounter(prompt_tokens=len(token_ids))
    request = frontend.build_request(request_id, body, token_ids)
    pieces = frontend.generate(request, body.stop_strings(), usage)
    # Wait for the first piece before answering, so routing errors still get their HTTP status.
    try:
        first = await anext(pieces)
    except StopAsyncIteration as exc:
        raise UpstreamError("the router returned no output") from exc
    frontend.metrics.ttft.observe(time.monotonic() - started)
    log.info("first token", prompt_tokens=len(token_ids), ttft_ms=round((time.monotonic() - started) * 1000, 2))

    def finished() -> None:
        frontend.metrics.latency.observe(time.monotonic() - started)
        frontend.metrics.prompt_tokens.inc(usage.prompt_tokens)
        frontend.metrics.cached_tokens.inc(usage.cached_tokens)
        log.info("request done", completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens)

    if not body.stream:
        text = [first.text]
        finish = first.finish_reason
        async for piece in pieces:
            text.append(piece.text)
            finish = piece.finish_reason or finish
        finished()
        content = "".join(text)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish,
                "logprobs": None,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return JSONResponse(
            {
                "id": request_id,
                "object": obj,
                "created": created,
                "model": body.model,
                "choices": [choice],
                "usage": usage.body(),
            },
            headers=_served_by(usage),
        )

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(piece: Piece, first_chunk: bool) -> dict[str, object]:
        if chat:
            delta: dict[str, object] = {"content": piece.text}
            if first_chunk:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": piece.finish_reason, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": piece.text, "finish_reason": piece.finish_reason, "logprobs": None}
            obj = "text_completion"
        out: dict[str, object] = {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": body.model,
            "choices": [choice],
        }
        if include_usage:
            out["usage"] = None
        return out

    async def events() -> AsyncIterator[bytes]:
        try:
            yield _sse(chunk(first, True))
            async for piece in pieces:
                yield _sse(chunk(piece, False))
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse(
                    {
                        "id": request_id,
                        "object": obj,
                        "created": created,
                        "model": body.model,
                        "choices": [],
                        "usage": usage.body(),
                    }
                )
            finished()
            yield b"data: [DONE]\n\n"
        except OpenAIError as exc:
            log.warning("stream failed", error=exc.message)
            yield _sse(exc.body())
            yield b"data: [DONE]\n\n"
        finally:
            await pieces.aclose()

    return StreamingResponse(events(), media_type="text/event-stream", headers=_served_by(usage))


def _served_by(usage: UsageCounter) -> dict[str, str]:
    """Response headers naming the worker that served the request (known once the first token came)."""
    return {WORKER_ID_HEADER: str(usage.worker_id)} if usage.worker_id is not None else {}
