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
from typing import NamedTuple

import msgspec

from asyncengine.block_manager import BlockManager
from asyncengine.config import EngineConfig
from asyncengine.errors import (
    AsyncEngineError,
    ConfigError,
    EngineDeadError,
    EngineShutdownError,
    InvalidRequestError,
)
from asyncengine.executor import Executor
from asyncengine.models.loader import get_model_config, model_max_len
from asyncengine.output_processor import OutputProcessor, RequestState
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from asyncengine.sequence import Sequence
from asyncengine.spec_decode import NgramProposer
from asyncengine.stats import EngineStats
from asyncengine.tokenizer import eos_token_ids, load_tokenizer, max_token_chars
from asyncengine.transport.wire import (
    CachedSeq,
    ExecuteModelRequest,
    ModelOutput,
    NewSeq,
    SamplingOptions,
    pack_ids,
    unpack_ids,
)

logger = logging.getLogger(__name__)

Prompt = str | list[int]
INLINE_TOKENIZE_CHARS = 4096  # shorter prompts tokenize on the loop (well under a millisecond)
# what a step's encoding raises on a value msgpack or int32 cannot hold (ints past 64 bits, ...)
ENCODE_ERRORS = (OverflowError, TypeError, ValueError, msgspec.EncodeError)


class TokenizedPrompt(NamedTuple):
    """A text prompt already tokenized (off the event loop), with its text for the outputs."""

    text: str
    token_ids: list[int]


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
            self.hf_config = get_model_config(config.model)
            limit = model_max_len(self.hf_config)
            self.max_model_len = min(config.max_model_len or limit, limit)
            self.tokenizer = load_tokenizer(config.tokenizer_path)
        except BaseException:
            self.executor.shutdown()
            raise
        self.vocab_size = int(getattr(self.hf_config, "vocab_size", 0))
        self.eos_ids = eos_token_ids(config.model, self.tokenizer)
        # no token is longer than this many characters, so a longer prompt cannot fit max_model_len:
        # refused before any tokenizing, which costs seconds on megabytes
        self.max_prompt_chars = self.max_model_len * max_token_chars(self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_ids, self.max_model_len)
        self.scheduler: Scheduler | None = None
        self.requests: dict[str, RequestState] = {}
        self.seq_owner: dict[int, RequestState] = {}
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._in_flight: deque[InFlight] = deque()
        # P batches fill a P-stage pipeline; with one stage, async scheduling keeps a second batch
        # queued so the worker never waits for the engine to process the last step's output
        self.run_ahead = config.run_ahead
        self.max_in_flight = 2 if self.run_ahead else config.pipeline_parallel_size
        self.dead: EngineDeadError | None = None
        self.closing = False

    # -- lifecycle --------------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig) -> AsyncEngine:
        """Starts the workers, loads the model and sizes the KV cache; returns a serving engine."""
        engine = cls(config)
        try:
            await engine.executor.start()
        except BaseException:
            engine.executor.shutdown()
            raise
        num_blocks = engine.executor.num_kv_blocks
        needed = -(-engine.max_model_len // config.block_size)
        if num_blocks < needed:
            engine.executor.shutdown()
            raise ConfigError(f"KV cache holds {num_blocks} blocks of {config.block_size} tokens, but one sequence "
                              f"of max_model_len={engine.max_model_len} needs {needed}: raise the KV memory or "
                              "lower max_model_len")
        bm = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        proposer = None
        if config.num_speculative_tokens:
            proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        engine.scheduler = sched = Scheduler(bm, config.max_num_seqs, config.max_num_batched_tokens,
                                             engine.max_model_len, num_batches=config.pipeline_parallel_size,
                                             run_ahead=engine.run_ahead, proposer=proposer,
                                             spec_token_budget=config.spec_token_budget)
        engine.stats.bind_scheduler(lambda: len(sched.running), lambda: len(sched.waiting), lambda: bm.usage,
                                    lambda: bm.num_free_blocks)
        engine._loop_task = asyncio.create_task(engine._run(), name="asyncengine-loop")
        return engine

    async def shutdown(self) -> None:
        """Aborts what is still running, stops the loop and the workers: no process is left behind."""
        self.closing = True
        for request_id in list(self.requests):
            self._abort(request_id)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, EngineDeadError):
                pass
        await asyncio.to_thread(self.executor.shutdown)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def is_running(self) -> bool:
        return self.dead is None and not self.closing and self._loop_task is not None

    # -- requests ---------------------------------------------------------------------------------
    def _check_prompt_chars(self, prompt: str) -> None:
        if len(prompt) > self.max_prompt_chars:
            raise InvalidRequestError(f"the prompt has {len(prompt)} characters, more than max_model_len "
                                      f"({self.max_model_len}) tokens can hold")

    def _encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompt token ids")
        self._check_prompt_chars(prompt)
        try:
            return self.tokenizer.encode(prompt)
        except TypeError:  # the Rust tokenizer refuses what UTF-8 cannot hold: lone surrogates ("\ud800")
            raise InvalidRequestError("the prompt is not valid Unicode (a lone surrogate?)") from None

    def _tokenize(self, prompt: Prompt | TokenizedPrompt) -> tuple[str | None, list[int]]:
        text: str | None
        if isinstance(prompt, TokenizedPrompt):  # before the list check: a NamedTuple is a tuple
            text, ids = prompt
        elif isinstance(prompt, str):
            text, ids = prompt, self._encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids, text = list(prompt), None
            if len(ids) < self.max_model_len and any(
                    not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        else:
            raise InvalidRequestError(f"the prompt must be a string or a list of token ids, not {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return text, ids

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        params.validate()
        if self.vocab_size and any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {self.vocab_size})")
        return params

    def _check_open(self, request_id: str) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        if self.closing or self.scheduler is None:
            raise EngineShutdownError("the engine is shutting down")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")

    def add_request(self, prompt: Prompt | TokenizedPrompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> RequestState:
        """Validates and queues a request; raises InvalidRequestError (or a subclass) on bad input."""
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        self._check_open(request_id)
        params = self._check_params(params)
        text, ids = self._tokenize(prompt)
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                      f"max_model_len ({self.max_model_len})")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        arrival = next(self._seq_ids)
        seqs = [Sequence(next(self._seq_ids), i, ids, params, max_tokens, arrival) for i in range(params.n)]
        state = RequestState(request_id, text, ids, params, seqs)
        self.output_processor.attach(state)
        self.requests[request_id] = state
        for seq in seqs:
            self.seq_owner[seq.seq_id] = state
            self.scheduler.add(seq)
        self.stats.on_arrival(len(ids))
        self._wake.set()
        return state

    def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutputs; leaving the loop early (or cancelling the task) aborts the request.

        The request is validated and queued at the call, so bad input raises here, before any output.
        A prompt of over INLINE_TOKENIZE_CHARS characters is tokenized in a thread, so that it never
        holds up other requests' tokens; its tokenizer errors then raise at the first iteration.
        """
        if isinstance(prompt, str) and len(prompt) > INLINE_TOKENIZE_CHARS:
            request_id = request_id if request_id is not None else uuid.uuid4().hex
            self._check_open(request_id)
            params = self._check_params(params)
            self._check_prompt_chars(prompt)
            return self._tokenize_then_stream(prompt, params, request_id)
        return self._stream(self.add_request(prompt, params, request_id))

    async def _tokenize_then_stream(self, prompt: str, params: SamplingParams,
                                    request_id: str) -> AsyncIterator[RequestOutput]:
        ids = await asyncio.to_thread(self._encode, prompt)
        stream = self._stream(self.add_request(TokenizedPrompt(prompt, ids), params, request_id))
        async with contextlib.aclosing(stream):  # closing early aborts the request, as for _stream
            async for out in stream:
                yield out

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
        for seq in state.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
            self._release(seq)
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

    def _finish_request(self, state: RequestState) -> None:
        if state.done:
            return
        state.done = True
        self.requests.pop(state.request_id, None)
        out = self.output_processor.make_output(state)
        if out is not None:
            out.finished = True
            state.queue.put_nowait(out)
        state.metrics.finished_time = time.monotonic()
        self.stats.on_finished(state)

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
        step_id = next(self._step_ids)
        new_seqs: list[NewSeq] = []
        cached: list[CachedSeq] = []
        new_items: list[ScheduledSeq] = []
        cached_items: list[ScheduledSeq] = []
        for item in sched.scheduled:
            seq, num, samples = item
            if not seq.on_workers:
                new_seqs.append(NewSeq(seq.seq_id, pack_ids(seq.token_ids), seq.num_prompt_tokens,
                                       list(seq.block_ids), seq.num_computed_tokens, num, self._options(seq)))
                new_items.append(item)
                seq.on_workers = True
            else:
                drafts = seq.draft_token_ids
                cached.append(CachedSeq(seq.seq_id, num, seq.token_ids[seq.num_tokens_on_workers :] + drafts,
                                        seq.block_ids[seq.num_blocks_on_workers :], seq.num_rejected_on_workers,
                                        len(drafts)))
                seq.num_rejected_on_workers = 0  # sent; _process sets it again once the drafts are verified
                cached_items.append(item)
            seq.num_tokens_on_workers = max(seq.num_tokens_on_workers, seq.num_tokens)
            seq.num_blocks_on_workers = len(seq.block_ids)
            if samples and self.run_ahead:
                seq.num_tokens_on_workers += 1  # the worker appends what it samples itself
        req = ExecuteModelRequest(step_id, new_seqs, cached, sched.dropped_seq_ids)
        try:
            nbytes = self.executor.send(req)
        except ENCODE_ERRORS:
            # NOTE: the API boundary bounds every field, so this is the second line of defence: the
            # requests whose part of the step cannot be encoded fail alone, the rest of the step goes out
            logger.exception("step %d does not encode; failing the requests it cannot carry", step_id)
            req, new_items, cached_items = self._without_unencodable(req, new_items, cached_items)
            if not new_items and not cached_items:
                assert self.scheduler is not None
                self.scheduler.requeue_dropped(req.finished_seq_ids)  # they ride on the next step
                return
            nbytes = self.executor.send(req)
        self.stats.on_step_sent(sched, nbytes)
        # NOTE: workers see new sequences first, then cached ones; outputs come back in that order
        in_worker_order = sched._replace(scheduled=new_items + cached_items)
        self._in_flight.append(InFlight(step_id, in_worker_order, time.monotonic()))

    def _without_unencodable(self, req: ExecuteModelRequest, new_items: list[ScheduledSeq],
                             cached_items: list[ScheduledSeq]) -> tuple[ExecuteModelRequest, list, list]:
        """The step without the sequences that do not encode, nor others of their requests; those
        requests fail with InvalidRequestError."""
        failed: set[str] = set()
        for item, part in zip(new_items + cached_items, req.new_seqs + req.cached_seqs):
            try:
                msgspec.msgpack.encode(part)
                if isinstance(part, NewSeq):
                    unpack_ids(part.token_ids)
            except ENCODE_ERRORS as e:
                state = self.seq_owner.get(item.seq.seq_id)
                if state is not None and not state.done:
                    failed.add(state.request_id)
                    self._fail_request(state, InvalidRequestError(f"the request cannot be sent to the workers: {e}"))

        def keep(item: ScheduledSeq) -> bool:
            state = self.seq_owner.get(item.seq.seq_id)
            if state is not None and state.request_id not in failed:
                return True
            seq, num, samples = item  # never sent: undo what schedule() counted in flight, then free it
            seq.num_inflight_steps -= 1
            seq.num_inflight_tokens -= num
            seq.num_pending_samples -= samples
            seq.aborted = False
            self._release(seq)
            return False

        new_kept = [i for i in new_items if keep(i)]
        cached_kept = [i for i in cached_items if keep(i)]
        kept_ids = {i.seq.seq_id for i in new_kept + cached_kept}
        req = ExecuteModelRequest(req.step_id, [s for s in req.new_seqs if s.seq_id in kept_ids],
                                  [s for s in req.cached_seqs if s.seq_id in kept_ids], req.finished_seq_ids)
        return req, new_kept, cached_kept

    def _fail_request(self, state: RequestState, error: AsyncEngineError) -> None:
        """Ends one request with `error` (raised in its consumer); its sequences are freed."""
        for seq in state.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
            self._release(seq)
        state.done = True
        self.requests.pop(state.request_id, None)
        state.queue.put_nowait(error)
        state.metrics.finished_time = time.monotonic()
        self.stats.on_finished(state)

    def _options(self, seq: Sequence) -> SamplingOptions:
        p = seq.params
        banned = sorted(self.eos_ids | set(p.stop_token_ids)) if p.min_tokens else []
        if p.ignore_eos:
            banned = sorted(set(p.stop_token_ids)) if p.min_tokens else []
        return SamplingOptions(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
            seed=None if p.seed is None else (p.seed + seq.index) % 2**63,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty, logprobs=p.logprobs, min_tokens=p.min_tokens,
            min_tokens_banned_ids=banned,
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
            if sampled:
                # with drafts: one token after each, kept up to and including the first that is not the
                # next draft (every kept token is then the model's own pick after the tokens before it)
                sampled_ids = tokens[k : k + 1 + len(drafts)]
                lp = output.logprobs[k] if output.logprobs else None
                k += 1 + len(drafts)
                accepted = 0
                while accepted < len(drafts) and sampled_ids[accepted] == drafts[accepted]:
                    accepted += 1
                if drafts:
                    seq.num_rejected_on_workers = len(drafts) - accepted
                    seq.num_tokens_on_workers = seq.num_tokens + accepted  # its kept drafts = our next tokens
                    self.stats.on_drafts(len(drafts), accepted)
                self.scheduler.on_step_done(seq, num, sampled, len(drafts) - accepted)
            else:
                self.scheduler.on_step_done(seq, num, sampled)
            state = self.seq_owner.get(seq.seq_id)
            if seq.aborted or seq.finish_reason is not None or state is None or state.done:
                # finished or aborted while this step ran (async scheduling runs one step past a stop)
                seq.aborted = True
                self._release(seq)
                continue
            if not sampled:
                continue
            for i, token in enumerate(sampled_ids[: accepted + 1]):
                self.output_processor.append_token(seq, token, lp if i == 0 else None)
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                    self.stats.on_first_token(state, now)
                else:
                    self.stats.on_token(state, now)
                if seq.finish_reason is not None:  # a stop inside the accepted drafts ends it there
                    break
            state.metrics.last_token_time = now
            if seq.finish_reason is not None:
                self._release(seq)
            touched[state.request_id] = state
        if k != len(tokens):
            raise EngineDeadError(f"step {step.step_id}: {len(tokens)} tokens where {k} were sampled")
        self.stats.on_step_done(step.sched, now - step.sent_at, output.execute_us)
        for state in touched.values():
            if state.all_finished:
                self._finish_request(state)
            else:
                out = self.output_processor.make_output(state)
                if out is not None:
                    state.queue.put_nowait(out)

    def _fail_all(self, error: EngineDeadError) -> None:
        self.dead = error
        for state in list(self.requests.values()):
            state.done = True
            state.queue.put_nowait(error)
        self.requests.clear()
        self.executor.kill_workers()
