"""What a request must pass before the API serves it: an API key, a body size limit, a limit on
requests in flight. Plain ASGI middleware (Starlette's ``BaseHTTPMiddleware`` would hide a client's
disconnect from the endpoint), each answering in OpenAI's error shape.

Health and metrics stay open: probes and scrapers carry no key and must see an overloaded frontend.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh.frontend.errors import OpenAIError

__all__ = ["ApiKeyGuard", "BodySizeLimit", "ConcurrencyLimit", "read_api_keys"]

OPEN_PATHS = frozenset({"/health", "/metrics"})


async def send_error(send: Send, status: int, error: OpenAIError, headers: Iterable[tuple[str, str]] = ()) -> None:
    body = json.dumps(error.body()).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in headers]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def _guarded(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["path"] not in OPEN_PATHS


def read_api_keys(keys: str | None, key_file: str | None) -> frozenset[str]:
    """Keys from a comma-separated list and from a file of one key per line (blank lines and lines
    starting with ``#`` skipped)."""
    found = {k.strip() for k in (keys or "").split(",") if k.strip()}
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise SystemExit(f"frontend: cannot read --api-key-file {key_file}: {exc}") from exc
        found |= {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}
    return frozenset(found)


class _Unauthorized(OpenAIError):
    status_code = 401
    error_type = "invalid_request_error"


class ApiKeyGuard:
    """Guarantees: with keys configured, no request but health and metrics reaches the app without
    ``Authorization: Bearer <one of the keys>`` (compared in constant time); it gets a 401."""

    def __init__(self, app: ASGIApp, keys: frozenset[str]) -> None:
        self.app = app
        self._keys = [key.encode() for key in keys]

    def _authorised(self, scope: Scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # every key compared, so the time taken says nothing about which one nearly matched
        return any([hmac.compare_digest(token, key) for key in self._keys])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._keys and _guarded(scope) and not self._authorised(scope):
            error = _Unauthorized(
                "a valid API key is required: send it as 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
            await send_error(send, 401, error, [("www-authenticate", "Bearer")])
            return
        await self.app(scope, receive, send)


class _TooLarge(OpenAIError):
    status_code = 413
    error_type = "invalid_request_error"


class _BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """Guarantees: the app never reads more than ``limit`` bytes of a request body; a larger body
    (by its Content-Length, or counted as it arrives when chunked) gets a 413."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _error(self) -> _TooLarge:
        return _TooLarge(f"the request body is larger than this server's limit of {self.limit} bytes", code="413")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.limit <= 0 or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await send_error(send, 413, self._error())
            return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _BodyTooLarge
            return message

        async def noting_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, noting_send)
        except _BodyTooLarge:
            if not started:
                await send_error(send, 413, self._error())


class _Overloaded(OpenAIError):
    status_code = 503
    error_type = "service_unavailable"


class ConcurrencyLimit:
    """Guarantees: at most ``limit`` requests (health and metrics aside) are inside the app at once,
    a stream counting until it ends; one more gets a 503 with ``Retry-After`` at once, not a queue."""

    def __init__(self, app: ASGIApp, limit: int, retry_after_secs: int = 1) -> None:
        self.app = app
        self.limit = limit
        self.retry_after_secs = retry_after_secs
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.limit <= 0 or not _guarded(scope):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            error = _Overloaded(
                f"this frontend is serving its limit of {self.limit} concurrent requests; retry shortly",
                code="too_many_concurrent_requests",
            )
            await send_error(send, 503, error, [("retry-after", str(self.retry_after_secs))])
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
