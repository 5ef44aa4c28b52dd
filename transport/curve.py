"""ZeroMQ CURVE keys for TCP transport: the head writes a key file (mode 0600) that the user copies
to the other nodes; no unauthenticated socket listens on a network address.

CURVE alone encrypts, but lets in any client that knows the server's public key. The head also runs
a ZAP handler (`ClientAllowlist`) that admits only the client public key(s) of its key file, so a
peer without that file's secret gets no connection at all: it can neither read the step broadcast
nor push results.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import zmq
import zmq.auth.thread

from asyncengine.transport.channels import CurveKeys

logger = logging.getLogger(__name__)


class KeyFileError(ValueError):
    """The CURVE key file is missing, unreadable or malformed."""


def generate_keys() -> CurveKeys:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def key_file_text(keys: CurveKeys) -> str:
    """The client's view as JSON: server public key + the client key pair (never the server's secret)."""
    if keys.client_public is None or keys.client_secret is None:
        raise KeyFileError("a key file needs the client key pair")
    return json.dumps(
        {
            "server_public": keys.server_public.decode(),
            "client_public": keys.client_public.decode(),
            "client_secret": keys.client_secret.decode(),
        }
    )


def write_key_text(text: str, path: str | Path) -> Path:
    """Writes a key file's text with mode 0600 (a pre-existing file is truncated and re-chmodded: it
    holds a secret)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def write_key_file(keys: CurveKeys, path: str | Path) -> Path:
    """The key file a worker on another node loads (`key_file_text`), mode 0600."""
    return write_key_text(key_file_text(keys), path)


def load_client_keys(path: str | Path) -> CurveKeys:
    try:
        data = json.loads(Path(path).read_text())
        return CurveKeys(
            server_public=data["server_public"].encode(),
            client_public=data["client_public"].encode(),
            client_secret=data["client_secret"].encode(),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise KeyFileError(f"cannot read the CURVE key file {path}: {e}") from e


class _AllowedKeys:
    """ZAP credentials provider: a fixed set of Z85 client public keys."""

    def __init__(self, keys: Iterable[bytes]) -> None:
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            logger.warning("refused a CURVE client with an unknown public key")
        return ok


class ClientAllowlist:
    """A ZAP handler on `ctx` that admits only CURVE clients whose public key is in `allowed`.

    NOTE: ZAP is per context: start it before binding the server sockets of `ctx`, and stop it
    before terminating `ctx` (its thread holds a socket there, so term() would block).
    """

    def __init__(self, ctx: zmq.Context, allowed: Iterable[bytes]) -> None:
        # an asyncio context cannot serve the handler's blocking thread: shadow it with a plain one
        sync = ctx if type(ctx) is zmq.Context else zmq.Context.shadow(ctx.underlying)
        self._auth = zmq.auth.thread.ThreadAuthenticator(sync)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=_AllowedKeys(allowed))

    def stop(self) -> None:
        self._auth.stop()
