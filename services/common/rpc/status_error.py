"""One error type for "this call fails with this gRPC status and this message"."""

from __future__ import annotations

import grpc


class StatusError(Exception):
    """A failure with the gRPC status it maps to and a message a user can act on.

    Raised inside a service where the answer is decided (no worker, bad disaggregation params, ...)
    and turned into the call's status at the servicer boundary; clients raise it for a status they
    received.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message
