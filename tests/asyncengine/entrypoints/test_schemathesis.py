"""Schemathesis against the OpenAPI schema the server publishes: every operation, bounded and derandomized.

The app runs in-process over a fake engine with a real (tiny) tokenizer, so chat, /tokenize and
/detokenize get past their tokenizer checks. The checks: no 5xx, every status documented, every body of
the documented content type and conforming to its schema. Bodies the schema allows may still be refused
(a 4xx), as ranges are the server's own checks. EXAMPLES examples per operation (and schemathesis' own
coverage cases); a failure reproduces on every run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import schemathesis
import transformers
from fake_engine import FakeEngine
from hypothesis import HealthCheck, settings
from schemathesis import checks
from test_app import KEY
from tiny_models import build_tokenizer

from asyncengine.entrypoints.server import build_app
from asyncengine.entrypoints.server_state import ServerLimits
from asyncengine.sampling_params import SamplingParams

# about 1,800 requests in 12-20 s (most for the two completion routes: schemathesis' coverage cases too)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
EXAMPLES = 30  # per operation

app = build_app(None, api_key=KEY, limits=ServerLimits(max_body_bytes=200_000))
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


class ShortEngine(FakeEngine):
    """FakeEngine, at most 3 tokens per request whatever max_tokens asks (generated bodies ask for 2**31)."""

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str):
        short = msgspec.structs.replace(
            params, max_tokens=min(params.max_tokens or 3, 3), min_tokens=min(params.min_tokens, 3)
        )
        async for out in super().generate(prompt, short, request_id):
            yield out


@pytest.fixture(scope="module", autouse=True)
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    path: Path = build_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    app.state.server.attach(ShortEngine(tokenizer=transformers.AutoTokenizer.from_pretrained(path)))
    yield


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_to_its_schema(case: schemathesis.Case) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, checks=CHECKS)
