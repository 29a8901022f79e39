"""Telling a dead peer from a real answer on gRPC.

A service that refuses a request on purpose (bad input, no worker, overloaded) aborts with trailing
metadata ``kvmesh-origin: <service>``. A failure without that mark came from the transport — the
process died, the connection broke — and is worth retrying elsewhere; a marked one is the answer and
is passed on to the caller.
"""

from __future__ import annotations

import grpc

from kvmesh.common.proto.kvmesh.v1 import common_pb2

ORIGIN_KEY = "kvmesh-origin"
# An overload refusal's advice to its caller, in seconds (HTTP's Retry-After at the facade).
RETRY_AFTER_KEY = "kvmesh-retry-after"
_TRANSPORT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED}
)


def origin_metadata(service: str, retry_after_secs: int = 0) -> tuple[tuple[str, str], ...]:
    if retry_after_secs > 0:
        return ((ORIGIN_KEY, service), (RETRY_AFTER_KEY, str(retry_after_secs)))
    return ((ORIGIN_KEY, service),)


def retry_after_of(error: grpc.aio.AioRpcError) -> int | None:
    """The seconds a refusal advises its caller to wait before it tries again; None if it gave none."""
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY and value.isdigit():
            return int(value)
    return None


def error_origin(error: grpc.aio.AioRpcError) -> str | None:
    """The service that refused on purpose, or None for a transport failure."""
    for key, value in error.trailing_metadata() or ():
        if key == ORIGIN_KEY:
            return value
    return None


# How a router's refusal for a model it sees no worker of begins: a caller with other router replicas
# asks another before it gives up (a replica's view of the workers may lag: docs/decisions/0033).
NO_WORKER = "no worker available"


def is_transport_failure(error: grpc.aio.AioRpcError) -> bool:
    """True when the peer (or the path to it) failed rather than answered."""
    return error.code() in _TRANSPORT_CODES and error_origin(error) is None


async def refuse(
    context: grpc.aio.ServicerContext, service: str, code: grpc.StatusCode, message: str, retry_after_secs: int = 0
) -> None:
    """Abort the call as a deliberate answer of ``service`` (never retried elsewhere); an overload
    refusal says when to come back (``retry_after_secs``)."""
    await context.abort(code, message, trailing_metadata=origin_metadata(service, retry_after_secs))


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def call_error(
    code: grpc.StatusCode, details: str, origin: str = "", retry_after_secs: int = 0
) -> grpc.aio.AioRpcError:
    """The error a call that failed raises on its caller's side, for a failure a shared stream
    reports instead of a call of its own: ``origin`` marks a deliberate refusal of that service;
    without it the error is a transport failure, which callers retry elsewhere."""
    trailing = grpc.aio.Metadata(*origin_metadata(origin, retry_after_secs)) if origin else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def error_of_end(end: common_pb2.RequestEnd) -> grpc.aio.AioRpcError:
    """The error a request's own call would have raised, from how it ended on a shared stream
    (its status, details and the ``kvmesh-origin`` of a refusal)."""
    code = _STATUS_BY_NUMBER.get(end.code, grpc.StatusCode.UNKNOWN)
    return call_error(code, end.details, end.origin, end.retry_after_secs)
