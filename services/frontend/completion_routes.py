"""The completion endpoints called straight, past FastAPI's routing and dependency machinery.

FastAPI spends about 35-45 µs of Python on every request before and after an endpoint that reads
its own body: its error and exception middlewares, an async exit stack, matching the path against
each route, solving the endpoint's (empty) dependencies, parsing query parameters and cookies
nobody reads. That is nearly a tenth of the frontend's CPU per answer (docs/decisions/0019). The
two completion routes are the hot path; everything else (health, metrics, models, the OpenAPI
document, unknown paths and wrong methods) is rare and keeps going through FastAPI.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from kvmesh.frontend.errors import OpenAIError

__all__ = ["CompletionRoutes"]


class CompletionRoutes:
    """Serves ``POST`` on the given paths by calling the endpoint FastAPI registered for it directly.

    Guarantees, the same answers as through FastAPI: the endpoint gets a Starlette ``Request`` and
    its response is sent as FastAPI would send it; an :class:`OpenAIError` becomes its JSON body and
    status (as the app's handler makes it); any other exception propagates, to the middlewares
    around these routes and to the server, which answers 500 and logs it. ``scope["route"]`` is set to
    the route, so request metrics keep their route label. Every other request goes to ``app``.
    """

    def __init__(self, app: FastAPI, paths: frozenset[str]) -> None:
        self.app = app
        self._routes = {
            route.path: route
            for route in app.routes
            if isinstance(route, APIRoute) and route.path in paths and "POST" in route.methods
        }
        missing = paths - self._routes.keys()
        if missing:
            raise ValueError(f"no POST route registered for {sorted(missing)}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = route
        scope["app"] = self.app
        try:
            response = await route.endpoint(Request(scope, receive))
        except OpenAIError as exc:
            response = JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)
        await response(scope, receive, send)
