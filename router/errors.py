"""Errors raised by the router, each mapped to an HTTP status and an OpenAI-style error body."""

from __future__ import annotations


class RouterError(Exception):
    """Base class: `http_status` and `error_body()` let the service map it to a response."""

    http_status = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def error_body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}} as the OpenAI API returns it."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(RouterError, ValueError):
    """The request cannot be classified: empty, not text, not UTF-8, malformed messages."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class AuthError(RouterError):
    """Missing or unknown API key."""

    http_status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(RouterError):
    """The tenant is not allowed to do this (domain override, domain outside its list)."""

    http_status = 403
    error_type = "permission_error"
    code = "permission_denied"


class RateLimited(RouterError):
    """The tenant's request or token bucket is empty; retry after `retry_after` seconds."""

    http_status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float, param: str | None = None):
        super().__init__(message, param=param)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        """HTTP headers for the 429 response."""
        return {"Retry-After": str(max(1, int(self.retry_after + 0.999)))}


class PolicyError(ValueError):
    """The tenant policy file is malformed; the message names the file and the field."""


class RouterLoadError(RuntimeError):
    """A router model file is missing, corrupt or incompatible; the message names file and fix."""
