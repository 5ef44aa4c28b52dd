"""A fake engine that answers with given text, for the structured-output and tool-calling API tests: what
the model "wrote" is fixed, so the tests pin how the API reads and spells it."""

from __future__ import annotations

from typing import Any

import openai
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from test_app import KEY

from asyncengine.entrypoints.server import build_app
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams


class ScriptedEngine(FakeEngine):
    """Answers every request with `texts` (one per choice, cycling), streamed in `pieces`-character deltas,
    finishing with `finish_reason`; keeps the prompts and params it was given. `error` is raised at the
    first iteration (as the engine raises a large grammar's compile error)."""

    def __init__(
        self,
        texts: list[str],
        tokenizer: Any = None,
        pieces: int = 3,
        finish_reason: str = "stop",
        error: Exception | None = None,
    ) -> None:
        super().__init__(tokenizer=tokenizer)
        self.texts = texts
        self.pieces = pieces
        self.finish_reason = finish_reason
        self.error = error
        self.prompts: list[Any] = []
        self.params: list[SamplingParams] = []

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str):
        self.prompts.append(prompt)
        self.params.append(params)
        if self.error is not None:
            raise self.error
        texts = [self.texts[i % len(self.texts)] for i in range(params.n)]
        if params.output_kind != OutputKind.DELTA:
            outputs = [
                CompletionOutput(i, t, list(range(len(t))), None, None, self.finish_reason)
                for i, t in enumerate(texts)
            ]
            yield RequestOutput(request_id, None, [7, 7], outputs, True)
            return
        longest = max(len(t) for t in texts)
        steps = max(1, -(-longest // self.pieces))
        for step in range(steps):
            last = step == steps - 1
            outputs = []
            for i, t in enumerate(texts):
                piece = (
                    t[step * self.pieces : (step + 1) * self.pieces] if not last else t[step * self.pieces :]
                )
                reason = self.finish_reason if last else None
                outputs.append(CompletionOutput(i, piece, [step], None, None, reason))
            yield RequestOutput(request_id, None, [7, 7], outputs, last)


def sdk(engine: Any, **app_kwargs: Any) -> openai.OpenAI:
    http = TestClient(build_app(engine, api_key=KEY, **app_kwargs))
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


def http(engine: Any, **app_kwargs: Any) -> TestClient:
    return TestClient(
        build_app(engine, api_key=KEY, **app_kwargs), headers={"Authorization": f"Bearer {KEY}"}
    )
