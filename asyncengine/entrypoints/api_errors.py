"""Errors of the serving layer and their HTTP status; shared by the OpenAI routes and the websocket."""

from __future__ import annotations

from asyncengine.errors import EngineDeadError, EngineShutdownError, InvalidRequestError

# OpenAI's error `type` for each status; the SDKs map the status itself to their exception classes
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error answered with `status` and OpenAI's error body; `param` names the offending field."""

    status = 400

    def __init__(self, message: str, status: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.param = param


class TooManyRequestsError(ApiError):
    """A live-request limit (global or per connection) is reached."""

    status = 429


class PayloadTooLargeError(ApiError):
    status = 413


class NotReadyError(ApiError):
    """The engine is still loading, shutting down, or dead."""

    status = 503


def status_of(exc: BaseException) -> int:
    """The HTTP status (also the websocket error code) that `exc` is answered with."""
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, (EngineDeadError, EngineShutdownError)):
        return 503
    if isinstance(exc, InvalidRequestError):
        return 400
    return 500


def message_of(exc: BaseException) -> str:
    if status_of(exc) == 500 and not isinstance(exc, ApiError):
        # NOTE: do not echo internals of unexpected errors to clients; they are logged instead
        return f"internal server error ({type(exc).__name__})"
    return str(exc)


def param_of(exc: BaseException) -> str | None:
    """The request field `exc` is about, where known (ApiError's and SamplingParamsError's `param`)."""
    param = getattr(exc, "param", None)
    return param if isinstance(param, str) else None


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}; `param` is the offending
    request field (e.g. "temperature"), or None."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": status,
        }
    }
