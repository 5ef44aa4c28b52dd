"""ZeroMQ CURVE keys for TCP transport: the head writes a key file (mode 0600) that the user copies
to the other nodes; no unauthenticated socket listens on a network address."""

from __future__ import annotations

import json
import os
from pathlib import Path

import zmq

from asyncengine.transport.channels import CurveKeys


def generate_keys() -> CurveKeys:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def write_key_file(keys: CurveKeys, path: str | Path) -> Path:
    """The client's view: server public key + the client key pair (never the server's secret)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        assert keys.client_public is not None and keys.client_secret is not None
        json.dump({"server_public": keys.server_public.decode(), "client_public": keys.client_public.decode(),
                   "client_secret": keys.client_secret.decode()}, f)
    return path


def load_client_keys(path: str | Path) -> CurveKeys:
    data = json.loads(Path(path).read_text())
    return CurveKeys(server_public=data["server_public"].encode(), client_public=data["client_public"].encode(),
                     client_secret=data["client_secret"].encode())
