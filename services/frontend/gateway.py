"""The frontend's core: turns an OpenAI request into a request on the mesh
(:class:`~kvmesh.common.calling.request_path.RequestPath`) and its outputs into text pieces."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvmesh.common.calling.request_path import RequestPath
from kvmesh.common.calling.router_client import NoRouterError
from kvmesh.common.proto.kvmesh.v1 import common_pb2
from kvmesh.common.rpc.grpc_errors import retry_after_of
from kvmesh.common.runtime.misconfiguration import Findings
from kvmesh.common.wire.finish_reasons import finish_name
from kvmesh.common.wire.priority import PRIORITY_HEADER, parse_priority
from kvmesh.common.wire.session import session_of
from kvmesh.frontend.errors import (
    BadRequestError,
    ModelNotFoundError,
    OpenAIError,
    ServiceUnavailableError,
    TooManyRequestsError,
    UpstreamError,
)
from kvmesh.frontend.load_window import LoadWindow
from kvmesh.frontend.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.frontend.tokenizer import ChatTemplateError, IncrementalDetokenizer, ModelTokenizer, StopStringMatcher

log = structlog.get_logger(__name__)

_GRPC_TO_HTTP: dict[grpc.StatusCode, type[OpenAIError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: BadRequestError,
    grpc.StatusCode.OUT_OF_RANGE: BadRequestError,
    grpc.StatusCode.NOT_FOUND: BadRequestError,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: TooManyRequestsError,
}
# Refusals a client may retry later: each carries Retry-After (the router's advice, else this).
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
DEFAULT_RETRY_AFTER_SECS = 1


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
    """Turns OpenAI requests into requests on the mesh and their outputs into OpenAI responses."""

    def __init__(self, model: ServedModel, path: RequestPath, default_max_tokens: int = 64) -> None:
        self.model = model
        self.path = path
        self.default_max_tokens = default_max_tokens
        self.metrics = FrontendMetrics()
        self.findings = Findings(self.metrics.registry)  # misconfigurations it sees (said in /health too)
        self.load = LoadWindow(f"frontend-{uuid.uuid4().hex[:8]}")
        # the LoRA adapters that workers of this model serve (the server reads them from discovery)
        self.adapters: Callable[[], frozenset[str]] = frozenset

    def check_model(self, name: str) -> None:
        """A 404 unless ``name`` is this frontend's model or an adapter a worker of it serves."""
        if name != self.model.name and name not in self.adapters():
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

    def prompt_token_ids(self, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
        """The prompt's token ids (chat messages rendered with the model's template), the model and the
        context checked: raises :class:`ModelNotFoundError` or :class:`BadRequestError` (the HTTP API's
        404 and 400; the endpoint picker's too)."""
        self.check_model(body.model)
        tokenizer = self.model.tokenizer
        if isinstance(body, ChatCompletionRequest):
            try:
                token_ids = tokenizer.encode(tokenizer.apply_chat_template(body.template_messages()))
            except ChatTemplateError as exc:
                raise BadRequestError(str(exc), param="messages") from exc
        elif isinstance(body.prompt, str):
            if not body.prompt:
                raise BadRequestError("prompt is empty", param="prompt")
            token_ids = tokenizer.encode(body.prompt)
        else:
            if any(t >= tokenizer.vocab_size for t in body.prompt):
                raise BadRequestError(
                    f"prompt token ids must be below the vocabulary size {tokenizer.vocab_size}", param="prompt"
                )
            token_ids = list(body.prompt)
        self.check_context(len(token_ids), body.requested_max_tokens())
        return token_ids

    def routing_hints(
        self, body: ChatCompletionRequest | CompletionRequest, headers: Mapping[str, str]
    ) -> tuple[str | None, str]:
        """The priority class the request's header names (None: none) and the session it names, both
        checked: a :class:`BadRequestError` naming the header or field otherwise (the HTTP API's and
        the endpoint picker's 400)."""
        priority = headers.get(PRIORITY_HEADER)
        if priority is not None:
            try:
                parse_priority(priority)
            except ValueError as exc:
                raise BadRequestError(f"{PRIORITY_HEADER}: {exc}", param=PRIORITY_HEADER) from None
        try:
            session = session_of(body.kvmesh.session if body.kvmesh else None, headers, body.user)
        except ValueError as exc:
            raise BadRequestError(str(exc), param=str(exc).split(":", 1)[0]) from None
        return priority, session

    def build_request(
        self,
        request_id: str,
        body: ChatCompletionRequest | CompletionRequest,
        token_ids: list[int],
        priority: str | None = None,
        session: str = "",
    ) -> common_pb2.PreprocessedRequest:
        """The request on the mesh; ``priority``: the router queue class (the header's, which wins
        over the body's ``kvmesh.priority``); ``session``: the session it names (checked)."""
        max_tokens = body.requested_max_tokens() or self.default_max_tokens
        request = common_pb2.PreprocessedRequest(request_id=request_id, model=self.model.name, token_ids=token_ids)
        if body.model != self.model.name:
            request.lora_name = body.model  # the model named an adapter (check_model let it through)
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
        priority = priority or (body.kvmesh.priority if body.kvmesh is not None else None)
        if priority:
            request.routing.priority = str(priority)
        if session:
            request.routing.session_id = session
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

        Migration and router failover happen below, in the request path: the client sees one answer.
        """
        request.whole_answer = whole
        detokenizer = IncrementalDetokenizer(self.model.tokenizer)
        matcher = StopStringMatcher(stop)
        try:
            # closing the stream when we stop early cancels the request: that frees its worker
            async with contextlib.aclosing(self.path.generate(request)) as outputs:
                async for output in outputs:
                    usage.completion_tokens = output.usage.completion_tokens
                    usage.cached_tokens = output.usage.cached_prompt_tokens
                    if output.worker_id:
                        usage.worker_id = output.worker_id
                    text, stopped = matcher.feed(detokenizer.add(output.token_ids))
                    if stopped:
                        yield Piece(text, "stop")
                        return
                    if output.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        yield Piece(text + matcher.flush(), finish_name(output.finish_reason, "stop"))
                        return
                    if text:
                        yield Piece(text)
        except NoRouterError as exc:
            raise ServiceUnavailableError(str(exc), retry_after_secs=DEFAULT_RETRY_AFTER_SECS) from exc
        except grpc.aio.AioRpcError as exc:
            raise _map_grpc_error(exc) from exc
        raise UpstreamError("the answer ended without a finish reason")


def _map_grpc_error(exc: grpc.aio.AioRpcError) -> OpenAIError:
    error_class = _GRPC_TO_HTTP.get(exc.code(), UpstreamError)
    retry_after = None
    if exc.code() in _RETRYABLE:
        retry_after = retry_after_of(exc) or DEFAULT_RETRY_AFTER_SECS
    code = "rate_limit_exceeded" if error_class is TooManyRequestsError else None
    return error_class(exc.details() or exc.code().name, code=code, retry_after_secs=retry_after)
