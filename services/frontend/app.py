"""The OpenAI-compatible HTTP facade: routes, body validation, chat template, tokenisation, errors
in OpenAI's shape. The request's path to the router is :mod:`~kvmesh.frontend.gateway`; response
bodies are :mod:`~kvmesh.frontend.responses`."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import structlog
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh.frontend.admission import ApiKeyGuard, BodySizeLimit, ConcurrencyLimit
from kvmesh.frontend.completion_routes import CompletionRoutes
from kvmesh.frontend.errors import BadRequestError, OpenAIError
from kvmesh.frontend.gateway import Frontend
from kvmesh.frontend.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.frontend.responses import respond

__all__ = ["create_app", "parse_body", "route_label"]

log = structlog.get_logger(__name__)


BodyT = TypeVar("BodyT", bound=BaseModel)


def parse_body(model: type[BodyT], raw: bytes) -> BodyT:
    """Parse a JSON request body whatever its Content-Type; any problem is a 400 naming the field."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # the parser recurses once per level: 100,000 "[" exhaust it
        raise BadRequestError("the request body is nested too deeply") from exc
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


def route_label(scope: Scope) -> str:
    """The route template a request matched, or ``unmatched``: labelling by raw path would make a new
    metric series for every path a scanner tries (unbounded memory)."""
    route = scope.get("route")
    return route.path if isinstance(route, BaseRoute) and hasattr(route, "path") else "unmatched"


class RequestCounter:
    """Counts HTTP requests by route and status. Plain ASGI rather than Starlette's
    ``BaseHTTPMiddleware``, which hides the client's disconnect from the endpoint (a non-streaming
    request whose client left would run on)."""

    def __init__(self, app: ASGIApp, counter: Any) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.counter.labels(route_label(scope), str(status[0])).inc()


def create_app(
    frontend: Frontend,
    api_keys: frozenset[str] = frozenset(),
    max_body_bytes: int = 0,
    max_concurrent_requests: int = 0,
) -> ASGIApp:
    """The API. ``api_keys``: when any, every request but health and metrics needs one as a Bearer
    token (401 without); ``max_body_bytes``: larger bodies are a 413; ``max_concurrent_requests``:
    one more is a 503 with Retry-After (0: no limit, for either).

    Every request is counted, then checked for its key, then against the limits; the completion
    routes are then called straight (:class:`CompletionRoutes`), everything else through FastAPI."""
    app = FastAPI(title="kvmesh", docs_url=None, redoc_url=None)
    metrics = frontend.metrics

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths and wrong methods answer in OpenAI's shape too, not FastAPI's ``detail``."""
        path = request.url.path
        message = {404: f"no such path: {path}", 405: f"{request.method} is not allowed on {path}"}
        error = OpenAIError(message.get(exc.status_code, str(exc.detail)), code=str(exc.status_code))
        error.error_type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health() -> JSONResponse:
        routers = len(frontend.path.routers.addresses())
        status = 200 if routers > 0 else 503
        body: dict[str, object] = {"status": "healthy" if status == 200 else "no router", "routers": routers}
        problems = frontend.findings.messages()
        if problems:
            body["misconfigurations"] = problems  # serving, but not as meant: said, not failed
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict[str, object]:
        model = frontend.model
        base = {"id": model.name, "object": "model", "created": model.created, "owned_by": "kvmesh"}
        # a LoRA adapter is listed as vLLM lists it: a model of its own, its base model its parent
        adapters = [{**base, "id": name, "parent": model.name} for name in sorted(frontend.adapters())]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await request.body())
        token_ids = frontend.prompt_token_ids(body)
        return await respond(frontend, body, token_ids, chat=True, http_request=request)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = parse_body(CompletionRequest, await request.body())
        token_ids = frontend.prompt_token_ids(body)
        return await respond(frontend, body, token_ids, chat=False, http_request=request)

    app.openapi = lambda: _openapi_with_bodies(app, frontend.model.name)  # type: ignore[method-assign]
    served: ASGIApp = CompletionRoutes(app, COMPLETION_PATHS)
    served = BodySizeLimit(served, limit=max_body_bytes)
    served = ConcurrencyLimit(served, limit=max_concurrent_requests)
    served = ApiKeyGuard(served, keys=api_keys)
    return RequestCounter(served, counter=metrics.requests)


COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
REQUEST_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest)
_SCHEMA_REF = "#/components/schemas/{model}"


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of an endpoint that parses ``model`` itself (from the raw body, so that
    any problem is a 400 in OpenAI's shape rather than FastAPI's 422)."""
    schema = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _openapi_with_bodies(app: FastAPI, model_name: str) -> dict[str, Any]:
    """FastAPI's document plus the request models' schemas, which it cannot see (the endpoints read
    the raw body): clients and API fuzzers (schemathesis, in the tests) learn the bodies from it.
    ``model`` is documented as the one model this frontend serves (any other name is a 404)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in REQUEST_MODELS:
            schema = model.model_json_schema(ref_template=_SCHEMA_REF)
            schemas.update(schema.pop("$defs", {}))
            schema["properties"]["model"]["enum"] = [model_name]
            schemas[model.__name__] = schema
        app.openapi_schema = document
    return app.openapi_schema
