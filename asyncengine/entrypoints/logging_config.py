"""One log format for the whole server process: the engine's loggers, uvicorn's (access log included).

`configure_logging` sets the root handler (stderr, LOG_FORMAT) at start-up; `uvicorn_log_config` is the
`log_config` handed to uvicorn.Config, whose loggers would otherwise print their own `INFO:     ...`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

# transformers warns on every slow tokenizer that encodes more tokens than its model_max_length; the
# engine rejects such a prompt itself (400, "... longer than the maximum model length"), so it is noise
TOO_LONG_LOGGER = "transformers.tokenization_utils_base"
TOO_LONG_PREFIX = "Token indices sequence length is longer than the specified maximum sequence length"


class DropTooLongWarning(logging.Filter):
    """Drops transformers' over-long-sequence warning (set on its logger: no transformers import needed)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TOO_LONG_PREFIX)


def silence_too_long_warning() -> None:
    """Installs DropTooLongWarning on transformers' tokenizer logger (once)."""
    target = logging.getLogger(TOO_LONG_LOGGER)
    if not any(isinstance(f, DropTooLongWarning) for f in target.filters):
        target.addFilter(DropTooLongWarning())


def configure_logging(level: str) -> None:
    """Root logging on stderr in LOG_FORMAT at `level` (one of LOG_LEVELS), minus transformers' noise."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=LOG_FORMAT)
    silence_too_long_warning()


def uvicorn_log_config(level: str = "info") -> dict[str, Any]:
    """uvicorn's loggers (uvicorn, uvicorn.error, uvicorn.access) on stderr in LOG_FORMAT.

    Whether the access log is on stays uvicorn.Config's `access_log` (off: its handlers are removed)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,  # the engine's loggers exist already and must keep logging
        "formatters": {"asyncengine": {"format": LOG_FORMAT}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "asyncengine",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},  # propagates to "uvicorn"
            "uvicorn.access": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
        },
    }
