"""The fake engine of the in-process serving tests: the app's routes (test_app and its neighbours), and
the websocket Connection of tests/reliability/test_slow_reader.py (its EndlessEngine builds on it; that
test loads this module by path, through reliability_helpers, as it does server_process)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from asyncengine.errors import EngineDeadError, InvalidRequestError
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams


class FakeEngine:
    """Yields one token per `delay` seconds: token i has id i and text "t{i} "."""

    def __init__(self, tokenizer: Any = None, delay: float = 0.001) -> None:
        # EngineConfig's fields the routes read (a real EngineConfig wants the model directory to exist)
        self.config = SimpleNamespace(
            model="/models/fake-model",
            dtype="auto",
            device="cpu",
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            data_parallel_size=1,
            distributed_executor_backend="mp",
        )
        self.hf_config = SimpleNamespace(torch_dtype="float16")  # config.json's: bfloat16 on a CPU
        self.tokenizer = tokenizer
        self.delay = delay
        self.dead: EngineDeadError | None = None
        self.closing = False
        self.is_running = True
        self.max_model_len = 128
        self.max_prompt_chars = 100_000
        self.stats = SimpleNamespace(registry=CollectorRegistry())
        self.live: set[str] = set()
        self.aborted: set[str] = set()

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str):
        if prompt == "bad":
            raise InvalidRequestError("bad prompt")
        self.live.add(request_id)
        ids: list[int] = []
        try:
            for i in range(params.max_tokens or 4):
                await asyncio.sleep(self.delay)
                last = i + 1 == params.max_tokens
                reason = "abort" if request_id in self.aborted else ("length" if last else None)
                ids.append(i)
                if params.output_kind == OutputKind.DELTA:
                    yield RequestOutput(
                        request_id,
                        None,
                        [7, 7],
                        [CompletionOutput(0, f"t{i} ", [i], None, None, reason)],
                        reason is not None,
                    )
                elif reason is not None:
                    text = "".join(f"t{j} " for j in ids)
                    yield RequestOutput(
                        request_id, None, [7, 7], [CompletionOutput(0, text, ids, None, None, reason)], True
                    )
                if reason is not None:
                    return
        finally:
            self.live.discard(request_id)

    async def abort(self, request_id: str) -> bool:
        if request_id not in self.live:
            return False
        self.aborted.add(request_id)
        return True
