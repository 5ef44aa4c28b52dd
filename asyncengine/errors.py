"""Typed exceptions raised at the API boundaries."""


class AsyncEngineError(Exception):
    """Base class of every error asyncengine raises on purpose."""


class ConfigError(AsyncEngineError, ValueError):
    """An invalid EngineConfig or model directory."""


class InvalidRequestError(AsyncEngineError, ValueError):
    """A request that can never be served: bad params, prompt too long, bad token ids. HTTP 400."""

    http_status = 400


class ModelLoadError(ConfigError):
    """Unknown architecture, missing or mismatched weights."""


class EngineDeadError(AsyncEngineError, RuntimeError):
    """A worker died or stopped answering; every in-flight request fails with this. HTTP 503."""

    http_status = 503


class EngineShutdownError(AsyncEngineError, RuntimeError):
    """The engine is shutting down and takes no new requests. HTTP 503."""

    http_status = 503


class RequestAbortedError(AsyncEngineError):
    """Raised inside a consumer whose request was aborted by someone else."""
