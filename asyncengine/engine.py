"""AsyncEngine: requests in, RequestOutputs streamed out; one asyncio loop drives the whole step.

    schedule -> send ExecuteModelRequest -> receive ModelOutput -> process outputs

With pipeline parallelism the loop keeps up to pp_size batches (of disjoint sequences) in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, NamedTuple

from asyncengine.config import EngineConfig
from asyncengine.errors import AsyncEngineError, EngineDeadError, EngineShutdownError, InvalidRequestError
from asyncengine.executor import Executor
from asyncengine.input_processor import INLINE_TOKENIZE_CHARS, InputProcessor, Prompt, TokenizedPrompt
from asyncengine.model_config import model_max_len, read_model_config
from asyncengine.output_processor import OutputProcessor, RequestState
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import Scheduler, SchedulerOutput
from asyncengine.sequence import Sequence
from asyncengine.spec_decode import accept_drafts
from asyncengine.stats import EngineStats
from asyncengine.step_encoder import ENCODE_ERRORS, StepEncoder
from asyncengine.structured_output.limits import INLINE_COMPILE_CHARS
from asyncengine.tokenizer import eos_token_ids, load_tokenizer
from asyncengine.transport.wire import ModelOutput, unpack_ids

if TYPE_CHECKING:
    from asyncengine.structured_output import CompiledGrammar

logger = logging.getLogger(__name__)


class InFlight(NamedTuple):
    step_id: int
    sched: SchedulerOutput
    sent_at: float


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = Executor(config)
        self.executor.spawn()  # workers start loading while this process reads configs and tokenizer
        try:
            self.hf_config = read_model_config(config.model)  # config.json, torch-free
            limit = model_max_len(self.hf_config)
            self.max_model_len = min(config.max_model_len or limit, limit)
            self.tokenizer = load_tokenizer(config.tokenizer_path)
        except BaseException:
            self.executor.shutdown()
            raise
        self.vocab_size = int(getattr(self.hf_config, "vocab_size", 0))
        self.eos_ids = eos_token_ids(config.model, self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, self.eos_ids
        )
        self.max_prompt_chars = self.input_processor.max_prompt_chars
        self.stats = EngineStats()
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_ids, self.max_model_len, self.stats)
        self.requests = self.output_processor.requests  # request_id -> RequestState, the live ones
        self.seq_owner: dict[int, RequestState] = {}  # seq_id -> its request, until the sequence is freed
        self.scheduler: Scheduler | None = None
        self._seq_ids, self._step_ids = itertools.count(), itertools.count()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._in_flight: deque[InFlight] = deque()
        # P batches fill a P-stage pipeline; one stage keeps a second queued, so workers never wait on us
        self.encoder = StepEncoder(self.eos_ids, config.run_ahead)
        self.max_in_flight = 2 if config.run_ahead else config.pipeline_parallel_size
        self.dead: EngineDeadError | None = None
        self.closing = False

    # -- lifecycle --------------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig) -> AsyncEngine:
        """Starts the workers, loads the model and sizes the KV cache; returns a serving engine."""
        engine = cls(config)
        try:
            await engine.executor.start()
            engine.scheduler = sched = Scheduler.from_config(
                config, engine.executor.num_kv_blocks, engine.max_model_len
            )
        except BaseException:
            engine.executor.shutdown()
            raise
        bm = sched.block_manager
        engine.stats.bind_scheduler(
            lambda: len(sched.running),
            lambda: len(sched.waiting),
            lambda: bm.usage,
            lambda: bm.num_free_blocks,
        )
        engine._loop_task = asyncio.create_task(engine._run(), name="asyncengine-loop")
        return engine

    async def shutdown(self) -> None:
        """Aborts what is still running, stops the loop and the workers: no process is left behind."""
        self.closing = True
        for request_id in list(self.requests):
            self._abort(request_id)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineDeadError):
                await self._loop_task
        try:
            await asyncio.to_thread(self.executor.shutdown)
        except RuntimeError:  # at interpreter exit no thread may be started: block the loop instead
            self.executor.shutdown()

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def num_kv_blocks(self) -> int:
        return self.executor.num_kv_blocks

    def idle_worker_exit(self) -> str | None:
        """Why a worker this engine started has exited, if one has (the server checks it while idle)."""
        for rank, proc in enumerate(self.executor.procs):
            code = proc.poll()
            if code is not None:
                return f"worker {rank} (pid {proc.pid}) exited with code {code}"
        return None

    @property
    def is_running(self) -> bool:
        return self.dead is None and not self.closing and self._loop_task is not None

    # -- requests ---------------------------------------------------------------------------------
    def _check_open(self, request_id: str) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        if self.closing or self.scheduler is None:
            raise EngineShutdownError("the engine is shutting down")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")

    def add_request(
        self,
        prompt: Prompt | TokenizedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> RequestState:
        """Validates and queues a request; raises InvalidRequestError (or a subclass) on bad input.
        `grammar`: params.structured_outputs compiled already (off the loop), else compiled here."""
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        self._check_open(request_id)
        params = self.input_processor.check_params(params)
        text, ids, max_tokens = self.input_processor.process(prompt, params)
        if grammar is None and params.structured_outputs is not None:
            grammar = self.input_processor.compile_grammar(params)
        arrival = next(self._seq_ids)
        seqs = [Sequence(next(self._seq_ids), i, ids, params, max_tokens, arrival) for i in range(params.n)]
        if grammar is not None:
            for seq in seqs:
                seq.grammar = grammar.matcher(params.stop_token_ids)
        state = RequestState(request_id, text, ids, params, seqs)
        self.output_processor.add_request(state)
        for seq in seqs:
            self.seq_owner[seq.seq_id] = state
            self.scheduler.add(seq)
        self._wake.set()
        return state

    def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutputs; leaving the loop early (or cancelling the task) aborts the request.

        The request is validated and queued at the call, so bad input raises here, before any output.
        A prompt of over INLINE_TOKENIZE_CHARS characters is tokenized in a thread, so that it never
        holds up other requests' tokens; its tokenizer errors then raise at the first iteration.
        """
        long_prompt = isinstance(prompt, str) and len(prompt) > INLINE_TOKENIZE_CHARS
        if long_prompt or self._large_grammar(params):
            request_id = request_id if request_id is not None else uuid.uuid4().hex
            self._check_open(request_id)
            params = self.input_processor.check_params(params)
            if isinstance(prompt, str):
                self.input_processor.check_prompt_chars(prompt)
            return self._prepare_then_stream(prompt, params, request_id)
        return self._stream(self.add_request(prompt, params, request_id))

    async def _prepare_then_stream(
        self, prompt: Prompt, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """A long prompt's tokenizing and a large grammar's compiling, in a thread; then the stream."""
        if isinstance(prompt, str) and len(prompt) > INLINE_TOKENIZE_CHARS:
            prompt = TokenizedPrompt(prompt, await asyncio.to_thread(self.input_processor.encode, prompt))
        grammar = None
        if params.structured_outputs is not None:
            grammar = await asyncio.to_thread(self.input_processor.compile_grammar, params)
        stream = self._stream(self.add_request(prompt, params, request_id, grammar))
        async with contextlib.aclosing(stream):  # closing early aborts the request, as for _stream
            async for out in stream:
                yield out

    # -- structured output ------------------------------------------------------------------------
    @staticmethod
    def _large_grammar(params: SamplingParams | None) -> bool:
        spec = params.structured_outputs if params is not None else None
        return spec is not None and len(spec.cache_key()) > INLINE_COMPILE_CHARS

    async def _stream(self, state: RequestState) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not state.done:
                self._abort(state.request_id)

    async def abort(self, request_id: str) -> bool:
        """Aborts a request and frees everything it holds; False if it is not running."""
        return self._abort(request_id)

    def _abort(self, request_id: str) -> bool:
        state = self.requests.get(request_id)
        if state is None:
            return False
        self._finish_request(state)
        return True

    def _release(self, seq: Sequence) -> None:
        """Frees a finished sequence now, or once its in-flight batch comes back."""
        assert self.scheduler is not None
        if seq.in_flight:
            seq.aborted = True
            return
        if not seq.is_finished:
            self.scheduler.finish(seq)
        self.seq_owner.pop(seq.seq_id, None)

    def _finish_request(self, state: RequestState, error: AsyncEngineError | None = None) -> None:
        """Ends a request (aborting what has not finished): its sequences are freed, its consumer gets
        the final output, or `error` raised."""
        for seq in state.seqs:
            seq.finish_reason = seq.finish_reason or "abort"
            self._release(seq)
        self.output_processor.finish(state, error)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's `reset_prefix_cache`), e.g. between benchmark runs; False
        (and nothing changed) while requests are live, whose blocks the cache also indexes."""
        if self.scheduler is None or self.requests or self.seq_owner:
            return False
        self.scheduler.block_manager.reset_prefix_cache()
        return True

    # -- the loop ---------------------------------------------------------------------------------
    async def _run(self) -> None:
        assert self.scheduler is not None
        try:
            while True:
                while len(self._in_flight) < self.max_in_flight:
                    sched = self.scheduler.schedule()
                    if not sched.scheduled:
                        break
                    self._send(sched)
                if not self._in_flight:
                    self._wake.clear()
                    await self.executor.wait_idle(self._wake)  # checks the workers' liveness meanwhile
                    continue
                output = await self.executor.recv_output(self.config.step_timeout)
                self._process(output)
        except EngineDeadError as e:
            self._fail_all(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in the loop must not leave requests hanging
            logger.exception("engine loop crashed")
            self._fail_all(EngineDeadError(f"engine loop crashed: {type(e).__name__}: {e}"))

    def _send(self, sched: SchedulerOutput) -> None:
        assert self.scheduler is not None
        step = self.encoder.encode(next(self._step_ids), sched)
        try:
            nbytes = self.executor.send(step.request)
        except ENCODE_ERRORS:
            # NOTE: the API boundary bounds every field, so this is the second line of defence: the
            # requests whose part of the step cannot be encoded fail alone, the rest of the step goes out
            logger.exception(
                "step %d does not encode; failing the requests it cannot carry", step.request.step_id
            )
            for seq_id, e in self.encoder.unencodable(step).items():
                if (state := self.seq_owner.get(seq_id)) is not None and not state.done:
                    self._finish_request(
                        state, InvalidRequestError(f"the request cannot be sent to the workers: {e}")
                    )
            unsent = [item for item in step.items if item.seq.aborted]  # the failed requests' sequences
            for item in unsent:  # undo what schedule() counted in flight, then free them
                self.scheduler.unschedule(item)
                item.seq.aborted = False
                self._release(item.seq)
            step = self.encoder.without(step, {item.seq.seq_id for item in unsent})
            if not step.items:
                self.scheduler.requeue_dropped(step.request.finished_seq_ids)  # they ride on the next step
                return
            nbytes = self.executor.send(step.request)
        self.stats.on_step_sent(sched, nbytes)
        # NOTE: workers see new sequences first, then cached ones; outputs come back in that order
        self._in_flight.append(
            InFlight(step.request.step_id, sched._replace(scheduled=step.items), time.monotonic())
        )

    def _process(self, output: ModelOutput) -> None:
        assert self.scheduler is not None
        step = self._in_flight.popleft()
        if output.step_id != step.step_id:
            raise EngineDeadError(f"output of step {output.step_id} arrived, step {step.step_id} expected")
        tokens = unpack_ids(output.sampled_token_ids)
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        k = 0
        for seq, num, sampled in step.sched.scheduled:
            drafts, seq.draft_token_ids = seq.draft_token_ids, []
            accepted = 0
            if sampled:
                sampled_ids = tokens[k : k + 1 + len(drafts)]
                lp = output.logprobs[k] if output.logprobs else None
                k += 1 + len(drafts)
                accepted = accept_drafts(drafts, sampled_ids)
                if drafts:
                    self.encoder.on_drafts_verified(seq, len(drafts), accepted)
                    self.stats.on_drafts(len(drafts), accepted)
            self.scheduler.on_step_done(seq, num, sampled, len(drafts) - accepted)
            state = self.seq_owner.get(seq.seq_id)
            if seq.aborted or seq.finish_reason is not None or state is None or state.done:
                # finished or aborted while this step ran (async scheduling runs one step past a stop)
                seq.aborted = True
                self._release(seq)
                continue
            if not sampled:
                continue
            self.output_processor.append_sampled(state, seq, sampled_ids[: accepted + 1], lp, now)
            if seq.finish_reason is not None:
                self._release(seq)
            touched[state.request_id] = state
        if k != len(tokens):
            raise EngineDeadError(f"step {step.step_id}: {len(tokens)} tokens where {k} were sampled")
        self.stats.on_step_done(step.sched, now - step.sent_at, output.execute_us)
        self.output_processor.publish(touched.values())

    def _fail_all(self, error: EngineDeadError) -> None:
        self.dead = error
        self.output_processor.fail_all(error)
        self.executor.kill_workers()
