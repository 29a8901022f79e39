"""An endpoint picker for the Gateway API Inference Extension: a gateway (Envoy, and the Istio,
kgateway or GKE gateways built on it) hands each inference request to this server over Envoy's
external processing protocol (``envoy.service.ext_proc.v3.ExternalProcessor``), and kvmesh chooses
the worker, as its own frontend would: the prompt tokenized with the model's tokenizer, the routers
asked (KV overlap, load, sessions, the queue), and the chosen worker's model server named in the
``x-gateway-destination-endpoint`` header and in the ``envoy.lb`` dynamic metadata. The gateway then
sends the request there itself. What comes back is reported to the router that routed it, as the
frontend reports a stream it serves: the response's headers as the first token, its end (or the
exchange's) as the end, so the request's load is freed.

Body modes: ``BUFFERED`` (the headers pass at once; the whole body comes in one message, and the
destination rides on the body's answer) and ``FULL_DUPLEX_STREAMED`` (the extension's default: the
headers' answer waits for the body, whose chunks are then handed back unchanged). ``STREAMED`` cannot
work: the headers would leave before the body that decides them, and is refused with a 500 that says
so. A request the picker cannot route gets an immediate answer in the OpenAI error shape: 400 for a
bad body, 404 for another model or path, 503 (with Retry-After) when no worker can take it.

Guarantees: every routed request is reported ended exactly once, whatever the exchange does (the
response finished, the gateway closed the stream, the picker failed); a request that was not
routed reports nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvmesh.common.calling.router_client import NoRouterError, RouterClient, route_request
from kvmesh.common.runtime.discovery import InstanceRecord
from kvmesh.common.wire.gateway_endpoint import DESTINATION_HEADER, METADATA_NAMESPACE, gateway_endpoint
from kvmesh.common.wire.request_reports import END, FIRST_TOKEN, RequestReport
from kvmesh.frontend.app import parse_body
from kvmesh.frontend.errors import BadRequestError, OpenAIError, ServiceUnavailableError
from kvmesh.frontend.gateway import DEFAULT_RETRY_AFTER_SECS, Frontend
from kvmesh.frontend.protocol import ChatCompletionRequest, CompletionRequest

log = structlog.get_logger(__name__)

EXT_PROC_SERVICE = ext_proc.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
STREAMED = processing_mode_pb2.ProcessingMode.BodySendMode.STREAMED
BODIES: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


class PickerMisconfigured(OpenAIError):
    status_code = 500


class UnroutablePath(OpenAIError):
    status_code = 404
    error_type = "invalid_request_error"


@dataclass
class _Exchange:
    """One HTTP request's passage through the gateway, as the picker sees it."""

    duplex_request: bool = False
    duplex_response: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    request_id: str = ""
    router: str = ""  # the replica that routed it ("" while not routed)
    first_reported: bool = False
    ended: bool = False
    status: int = 0

    def answered(self) -> str:
        """The outcome of a response that came to its end: completed unless it was an error."""
        return "completed" if self.status < 400 else "cancelled"


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):
    """``ExternalProcessor.Process``: one stream per HTTP request."""

    def __init__(
        self, frontend: Frontend, routers: RouterClient, workers: Callable[[], Sequence[InstanceRecord]]
    ) -> None:
        self.frontend = frontend
        self.routers = routers
        self.workers = workers

    async def Process(
        self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = _Exchange()
        try:
            async for message in request_iterator:
                for response in await self._answer(exchange, message):
                    yield response
        finally:
            self._end(exchange, "completed" if 0 < exchange.status < 400 else "cancelled")

    async def _answer(
        self, exchange: _Exchange, message: ext_proc.ProcessingRequest
    ) -> list[ext_proc.ProcessingResponse]:
        if message.HasField("protocol_config"):  # sent with the first message, by gateways that know it
            config = message.protocol_config
            exchange.duplex_request = config.request_body_mode == FULL_DUPLEX
            exchange.duplex_response = config.response_body_mode == FULL_DUPLEX
            if config.request_body_mode == STREAMED:
                return [self._refusal(exchange, _streamed_body())]
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            exchange.headers = _header_map(message.request_headers)
            if message.request_headers.end_of_stream:
                return [self._refusal(exchange, BadRequestError("a completion request needs a JSON body"))]
            # in full duplex the headers' answer carries the destination: it waits for the body
            return (
                []
                if exchange.duplex_request
                else [ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())]
            )
        if kind == "request_body":
            exchange.body += message.request_body.body
            if not message.request_body.end_of_stream:
                if not exchange.duplex_request:  # a chunk in a mode that needs an answer per chunk
                    return [self._refusal(exchange, _streamed_body())]
                return []
            return await self._pick(exchange)
        if kind == "response_headers":
            exchange.status = _status(_header_map(message.response_headers))
            self._first_token(exchange)
            if message.response_headers.end_of_stream:
                self._end(exchange, exchange.answered())
            return [ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())]
        if kind == "response_body":
            body = message.response_body
            self._first_token(exchange)
            if body.end_of_stream:
                self._end(exchange, exchange.answered())
            if exchange.duplex_response:  # handed back as it came
                return [_body_answer(_passed_on(body.body, body.end_of_stream), response=True)]
            return [ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())]
        if kind == "request_trailers":
            return [ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())]
        if kind == "response_trailers":
            self._end(exchange, exchange.answered())
            return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())]
        return []

    async def _pick(self, exchange: _Exchange) -> list[ext_proc.ProcessingResponse]:
        try:
            endpoint = await self._route(exchange)
        except OpenAIError as error:
            return [self._refusal(exchange, error)]
        mutation = ext_proc.CommonResponse(
            header_mutation=ext_proc.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=endpoint.encode())
                    )
                ]
            ),
            clear_route_cache=True,
        )
        metadata = struct_pb2.Struct()
        metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: endpoint}})
        if not exchange.duplex_request:
            return [
                ext_proc.ProcessingResponse(
                    request_body=ext_proc.BodyResponse(response=mutation), dynamic_metadata=metadata
                )
            ]
        headers = ext_proc.ProcessingResponse(
            request_headers=ext_proc.HeadersResponse(response=mutation), dynamic_metadata=metadata
        )
        return [headers, _body_answer(_passed_on(bytes(exchange.body), True), response=False)]

    async def _route(self, exchange: _Exchange) -> str:
        """Route the request; returns the chosen worker's model server address."""
        path = exchange.headers.get(":path", "").split("?", 1)[0]
        body_class = BODIES.get(path)
        if body_class is None:
            raise UnroutablePath(f"path {path or '(none)'}: the picker routes {' and '.join(BODIES)}")
        body = parse_body(body_class, bytes(exchange.body))
        token_ids = self.frontend.prompt_token_ids(body)
        exchange.request_id = exchange.headers.get("x-request-id") or f"epp-{uuid.uuid4().hex}"
        priority, session = self.frontend.routing_hints(body, exchange.headers)
        sent = self.frontend.build_request(exchange.request_id, body, token_ids, priority=priority, session=session)
        try:
            address = self.routers.pick()
        except NoRouterError as exc:
            raise ServiceUnavailableError(
                "no router replica is registered", retry_after_secs=DEFAULT_RETRY_AFTER_SECS
            ) from exc
        try:
            route = await self.routers.route(address, route_request(sent))
        except grpc.aio.AioRpcError as exc:
            raise ServiceUnavailableError(
                f"the router refused the request: {exc.details() or exc.code().name}",
                retry_after_secs=DEFAULT_RETRY_AFTER_SECS,
            ) from exc
        exchange.router = address
        record = next((r for r in self.workers() if r.instance_id == route.worker_id), None)
        endpoint = gateway_endpoint(record.extra) if record is not None else None
        if endpoint is None:
            # routed, so counted: free it before refusing
            self._end(exchange, "unavailable")
            why = "has left" if record is None else "advertises no gateway endpoint (kvmesh worker --gateway-endpoint)"
            raise ServiceUnavailableError(f"worker {route.worker_id} {why}", retry_after_secs=DEFAULT_RETRY_AFTER_SECS)
        log.debug("picked", request_id=exchange.request_id, worker_id=route.worker_id, endpoint=endpoint)
        return endpoint

    def _refusal(self, exchange: _Exchange, error: OpenAIError) -> ext_proc.ProcessingResponse:
        log.info("refused", status=error.status_code, reason=error.message, request_id=exchange.request_id or None)
        headers = [("content-type", "application/json"), *error.headers.items()]
        return ext_proc.ProcessingResponse(
            immediate_response=ext_proc.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=error.status_code),
                headers=ext_proc.HeaderMutation(
                    set_headers=[
                        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
                        for k, v in headers
                    ]
                ),
                body=json.dumps(error.body()).encode(),
                details=f"kvmesh endpoint picker: {error.message}",
            )
        )

    def _first_token(self, exchange: _Exchange) -> None:
        if exchange.router and not exchange.first_reported and not exchange.ended:
            exchange.first_reported = True
            self.routers.report(exchange.router, RequestReport(FIRST_TOKEN, exchange.request_id))

    def _end(self, exchange: _Exchange, outcome: str) -> None:
        if exchange.router and not exchange.ended:
            exchange.ended = True
            self.routers.report(exchange.router, RequestReport(END, exchange.request_id, outcome))


def _streamed_body() -> OpenAIError:
    return PickerMisconfigured(
        "the gateway streams the request body in STREAMED mode, where the destination header would leave before "
        "the body that decides it: configure request_body_mode BUFFERED or FULL_DUPLEX_STREAMED"
    )


def _header_map(headers: ext_proc.HttpHeaders) -> dict[str, str]:
    return {
        h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
        for h in headers.headers.headers
    }


def _status(headers: dict[str, str]) -> int:
    try:
        return int(headers.get(":status", "200"))
    except ValueError:
        return 200


def _passed_on(chunk: bytes, end_of_stream: bool) -> ext_proc.CommonResponse:
    return ext_proc.CommonResponse(
        body_mutation=ext_proc.BodyMutation(
            streamed_response=ext_proc.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
        )
    )


def _body_answer(common: ext_proc.CommonResponse, *, response: bool) -> ext_proc.ProcessingResponse:
    body = ext_proc.BodyResponse(response=common)
    return (
        ext_proc.ProcessingResponse(response_body=body) if response else ext_proc.ProcessingResponse(request_body=body)
    )
