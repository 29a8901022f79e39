"""Errors the HTTP facade answers with, in OpenAI's error format."""

from __future__ import annotations

from typing import Any


class OpenAIError(Exception):
    """An error a client should see as ``{"error": {...}}`` with an HTTP status."""

    status_code = 500
    error_type = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, retry_after_secs: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_secs = retry_after_secs

    @property
    def headers(self) -> dict[str, str]:
        """Response headers: ``Retry-After`` on an overload refusal."""
        return {"retry-after": str(self.retry_after_secs)} if self.retry_after_secs is not None else {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequestError(OpenAIError):
    status_code = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(OpenAIError):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist", param="model", code="model_not_found")


class ServiceUnavailableError(OpenAIError):
    status_code = 503
    error_type = "service_unavailable"


class TooManyRequestsError(OpenAIError):
    """Overload the client should back off from (the router queue is full): 429, with Retry-After."""

    status_code = 429
    error_type = "rate_limit_error"


class UpstreamError(OpenAIError):
    status_code = 502
    error_type = "upstream_error"
