"""`asyncengine.client.AsyncClient`: the websocket client (implemented in asyncengine.entrypoints.client)."""

from asyncengine.entrypoints.client import (
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    ClientConnectionError,
    ClientError,
    Completion,
    ConnectionLost,
    Delta,
    InternalServerError,
    PayloadTooLargeError,
    RateLimitError,
    ServerError,
    ServiceUnavailableError,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "ClientConnectionError",
    "ClientError",
    "Completion",
    "ConnectionLost",
    "Delta",
    "InternalServerError",
    "PayloadTooLargeError",
    "RateLimitError",
    "ServerError",
    "ServiceUnavailableError",
    "Usage",
]
