"""LLM: the offline, synchronous wrapper over the same AsyncEngine (vLLM's `LLM(...).generate`)."""

from __future__ import annotations

import asyncio
import atexit
import threading
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from tqdm import tqdm

from asyncengine.config import EngineConfig
from asyncengine.engine import AsyncEngine, Prompt
from asyncengine.errors import ConfigError
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import OutputKind, SamplingParams

T = TypeVar("T")
EXIT_TIMEOUT_S = 10.0  # for an engine left running at exit or garbage collection


class LLM:
    """`LLM(model=..., **EngineConfig fields).generate(prompts, params)`; outputs in prompt order."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        self.config = EngineConfig(**kwargs)
        if self.config.data_parallel_size > 1:
            raise ConfigError(
                "LLM runs one engine; data-parallel replicas are served by `asyncengine serve -dp N` or "
                "asyncengine.dp_engine.DataParallelEngine"
            )
        # the engine lives on its own event loop thread, so LLM works inside async code too
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="asyncengine-llm", daemon=True)
        self._thread.start()
        self.engine: AsyncEngine = self._call(AsyncEngine.start(self.config))
        # a script that never calls shutdown(): stop the engine at exit, while the loop thread still runs
        # (by the time __del__ runs at interpreter exit, that daemon thread is frozen: waiting on it hangs)
        ref = weakref.ref(self)
        self._atexit = lambda: (llm := ref()) is not None and llm.shutdown(EXIT_TIMEOUT_S)
        atexit.register(self._atexit)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompts)
        else:
            param_list = list(params)
            if len(param_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(param_list)} SamplingParams")
        return self._call(self._generate_all(prompts, param_list, use_tqdm))

    async def _generate_all(
        self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        states = []
        for p, sp in zip(prompts, params):
            final = SamplingParams(
                **{f: getattr(sp, f) for f in sp.__struct_fields__ if f != "output_kind"},
                output_kind=OutputKind.FINAL_ONLY,
            )
            states.append(self.engine.add_request(p, final))
        bar = tqdm(total=len(states), disable=not use_tqdm, desc="generate")

        async def wait(state: Any) -> RequestOutput:
            item = await state.queue.get()
            bar.update(1)
            if isinstance(item, BaseException):
                raise item
            return item

        try:
            return list(await asyncio.gather(*(wait(s) for s in states)))
        finally:
            bar.close()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False while requests run (AsyncEngine.reset_prefix_cache)."""

        async def reset() -> bool:
            return self.engine.reset_prefix_cache()

        return self._call(reset())

    def shutdown(self, timeout: float | None = None) -> None:
        """Stops the engine and its workers (at exit: within `timeout`, then the workers' death pipes
        take them down with this process)."""
        atexit.unregister(self._atexit)
        if self._loop.is_running() and self._thread.is_alive():
            try:
                self._call(self.engine.shutdown(), timeout)
            except TimeoutError:
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown(EXIT_TIMEOUT_S)
        except Exception:
            pass
