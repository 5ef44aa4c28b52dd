"""A real `asyncengine serve` subprocess shared by the server, client and CLI tests (start-up is the
slow part)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import API_KEY, ServerProcess, start_server


@pytest.fixture(scope="session")
def chat_model(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", tokenizer=True)


@pytest.fixture(scope="session")
def server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the session: API key, small body and frame limits so limit tests stay cheap."""
    tmp = tmp_path_factory.mktemp("server")
    srv = start_server(
        chat_model,
        tmp,
        "--max-body-bytes",
        "200000",
        "--max-frame-bytes",
        "65536",
        "--max-live-per-connection",
        "128",
        env={"ASYNCENGINE_API_KEY": API_KEY},
    )
    yield srv
    srv.kill()
