"""DataParallelEngine: N independent AsyncEngines (replicas) behind one API (`--data-parallel-size N`).

Each replica has its own workers, KV cache and scheduler (and may itself be PP x TP); they share this
process's event loop, the tokenizer and the server. A request goes to one replica for its whole life:

* the replica with the fewest outstanding tokens (prompt tokens not yet computed + tokens still to
  generate, as estimated at routing and updated as outputs stream);
* unless the prompt's leading full KV blocks were recently routed to some replica (prefix affinity:
  its prefix cache likely holds them) and that replica is not clearly busier: at most
  AFFINITY_LOAD_FACTOR times the least loaded one's load plus one step's token budget.

A replica that dies fails only its own in-flight requests; a request that has streamed nothing yet is
retried on a live replica. The engine is dead only when every replica is; until then `degraded` names
the dead ones (and /health says so). Metrics keep one registry per replica, exposed with a `replica`
label (`DataParallelStats`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from asyncengine.config import EngineConfig
from asyncengine.engine import AsyncEngine
from asyncengine.errors import EngineDeadError, EngineShutdownError, InvalidRequestError
from asyncengine.input_processor import INLINE_TOKENIZE_CHARS, Prompt, TokenizedPrompt
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.stats import StatsSnapshot

logger = logging.getLogger(__name__)

AFFINITY_LOAD_FACTOR = 2.0
AFFINITY_BLOCKS = 4  # leading full blocks hashed for affinity (longer shared prefixes match the same)
AFFINITY_ENTRIES = 8192  # remembered prefixes, least recently routed dropped first


class DataParallelStats:
    """The replicas' metrics as one registry, each sample labelled replica="i"; snapshots summed."""

    def __init__(self, replicas: list[AsyncEngine]) -> None:
        self.replicas = replicas
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for i, replica in enumerate(self.replicas):
            for family in replica.stats.registry.collect():
                out = families.get(family.name)
                if out is None:
                    out = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                out.samples += [s._replace(labels={"replica": str(i), **s.labels}) for s in family.samples]
        yield from families.values()

    def snapshot(self) -> StatsSnapshot:
        snaps = [r.stats.snapshot() for r in self.replicas]
        return StatsSnapshot(
            max(s.time for s in snaps),
            sum(s.prompt_tokens for s in snaps),
            sum(s.generation_tokens for s in snaps),
            sum(s.running for s in snaps),
            sum(s.waiting for s in snaps),
            sum(s.kv_usage for s in snaps) / len(snaps),
        )


class DataParallelEngine:
    def __init__(self, config: EngineConfig, replicas: list[AsyncEngine]) -> None:
        self.config = config
        self.replicas = replicas
        first = replicas[0]
        self.hf_config = first.hf_config
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.max_prompt_chars = first.max_prompt_chars
        self.vocab_size = first.vocab_size
        self.stats = DataParallelStats(replicas)
        self.load = [0] * len(replicas)  # outstanding tokens per replica
        self.owner: dict[str, int] = {}  # live request id -> replica index
        self.routed = [0] * len(replicas)  # requests sent to each replica, since start
        self._affinity: OrderedDict[bytes, int] = OrderedDict()
        self.closing = False
        self._ray_owned = False  # DataParallelEngine.start connected to (or started) Ray for the replicas

    @classmethod
    async def start(cls, config: EngineConfig) -> DataParallelEngine:
        """Starts config.data_parallel_size replicas at once; all of them start, or none is left."""
        ray_owned = False
        if config.distributed_executor_backend == "ray":  # one Ray connection shared by the replicas
            from asyncengine.ray_launcher import ensure_ray

            ray_owned = await asyncio.to_thread(ensure_ray, config)
        starting = [AsyncEngine.start(config) for _ in range(config.data_parallel_size)]
        results = await asyncio.gather(*starting, return_exceptions=True)
        replicas = [r for r in results if isinstance(r, AsyncEngine)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(r.shutdown() for r in replicas), return_exceptions=True)
            if ray_owned:
                from asyncengine.ray_launcher import release_ray

                release_ray()
            raise errors[0]
        engine = cls(config, replicas)
        engine._ray_owned = ray_owned
        return engine

    async def shutdown(self) -> None:
        self.closing = True
        await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)
        if self._ray_owned:
            from asyncengine.ray_launcher import release_ray

            await asyncio.to_thread(release_ray)
            self._ray_owned = False

    async def __aenter__(self) -> DataParallelEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # -- state ------------------------------------------------------------------------------------
    @property
    def dead(self) -> EngineDeadError | None:
        """Dead only when every replica is (the last one's reason)."""
        if all(r.dead is not None for r in self.replicas):
            return self.replicas[-1].dead
        return None

    @property
    def degraded(self) -> list[int]:
        """Indices of the dead replicas while others still serve."""
        return [i for i, r in enumerate(self.replicas) if r.dead is not None]

    @property
    def is_running(self) -> bool:
        return not self.closing and any(r.is_running for r in self.replicas)

    @property
    def requests(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for r in self.replicas:
            out.update(r.requests)
        return out

    @property
    def num_kv_blocks(self) -> int:
        return min(r.num_kv_blocks for r in self.replicas)

    def idle_worker_exit(self) -> str | None:
        """Why the engine is dead while idle: only when every replica has a dead worker."""
        reasons = [r.idle_worker_exit() or (str(r.dead) if r.dead else None) for r in self.replicas]
        return reasons[-1] if all(reasons) else None

    # -- routing ----------------------------------------------------------------------------------
    def _live(self, exclude: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
        return [i for i, r in enumerate(self.replicas) if r.is_running and i not in exclude]

    def _prefix_keys(self, ids: list[int]) -> list[bytes]:
        """Chained hashes of the leading full blocks, shortest first."""
        size = self.config.block_size
        keys, h = [], hashlib.blake2b(digest_size=16)
        for b in range(min(len(ids) // size, AFFINITY_BLOCKS)):
            h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in ids[b * size : (b + 1) * size]))
            keys.append(h.copy().digest())
        return keys

    def route(self, ids: list[int], exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """The replica for a prompt (see the module docstring); EngineDeadError when none is live."""
        live = self._live(exclude)
        if not live:
            if self.closing or any(r.closing for r in self.replicas):
                raise EngineShutdownError("the engine is shutting down")
            raise EngineDeadError(f"every replica is dead: {self.replicas[-1].dead}")
        least = min(live, key=lambda i: (self.load[i], self.routed[i]))
        keys = self._prefix_keys(ids)
        choice = least
        for key in reversed(keys):  # the longest remembered prefix wins
            cand = self._affinity.get(key)
            if cand is not None and cand in live:
                budget = self.config.max_num_batched_tokens
                if self.load[cand] <= AFFINITY_LOAD_FACTOR * self.load[least] + budget:
                    choice = cand
                break
        for key in keys:
            self._affinity[key] = choice
            self._affinity.move_to_end(key)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return choice

    # -- requests ---------------------------------------------------------------------------------
    def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate: bad input raises here; a long text prompt is tokenized in a thread."""
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self.owner:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        live = self._live()
        ref = self.replicas[live[0]] if live else self.replicas[0]
        processor = ref.input_processor
        params = processor.check_params(params)
        if isinstance(prompt, str):
            processor.check_prompt_chars(prompt)
            if len(prompt) > INLINE_TOKENIZE_CHARS:
                self.route([], set(range(len(self.replicas))) - set(live))  # dead / closing: raise now
                return self._tokenize_then_stream(prompt, params, request_id)
            prompt = TokenizedPrompt(prompt, processor.encode(prompt))
        return self._start(prompt, params, request_id)

    async def _tokenize_then_stream(
        self, prompt: str, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        ids = await asyncio.to_thread(self.replicas[0].input_processor.encode, prompt)
        async for out in self._start(TokenizedPrompt(prompt, ids), params, request_id):
            yield out

    def _start(
        self, prompt: Prompt | TokenizedPrompt, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        ids = _ids(prompt)
        index = self.route(ids)
        stream = self.replicas[index].generate(prompt, params, request_id)  # validates: raises here
        estimate = self._estimate(ids, params)
        self._charge(request_id, index, estimate)  # at the call, so a burst of requests spreads
        return self._follow(index, stream, prompt, params, request_id, estimate)

    def _estimate(self, ids: list[int], params: SamplingParams) -> int:
        room = max(self.max_model_len - len(ids), 0)
        new = room if params.max_tokens is None else min(params.max_tokens, room)
        return len(ids) + new * params.n

    def _charge(self, request_id: str, index: int, tokens: int) -> None:
        self.owner[request_id] = index
        self.load[index] += tokens
        self.routed[index] += 1

    async def _follow(
        self,
        index: int,
        stream: AsyncIterator[RequestOutput],
        prompt: Prompt | TokenizedPrompt,
        params: SamplingParams,
        request_id: str,
        estimate: int,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the replica's outputs, keeping its load current; retries on another replica when
        this one dies before anything was streamed."""
        ids = _ids(prompt)
        tried = {index}
        charged, streamed = estimate, False
        try:
            while True:
                try:
                    async for out in stream:
                        streamed = True
                        done = len(ids) + sum(len(c.token_ids) for c in out.outputs)
                        left = max(estimate - done, 0)
                        self.load[index] -= charged - left
                        charged = left
                        yield out
                    return
                except EngineDeadError:
                    if streamed or not self._live(tried):
                        raise
                    # nothing reached the client yet: run it on a live replica instead
                    self.load[index] -= charged
                    charged = 0
                    dead, index = index, self.route(ids, tried)
                    tried.add(index)
                    logger.warning(
                        "replica %d died before request %s streamed: retrying on replica %d",
                        dead,
                        request_id,
                        index,
                    )
                    stream = self.replicas[index].generate(prompt, params, request_id)
                    self._charge(request_id, index, estimate)
                    charged = estimate
        finally:
            self.load[index] -= charged
            self.owner.pop(request_id, None)
            await stream.aclose()  # type: ignore[attr-defined]

    async def abort(self, request_id: str) -> bool:
        index = self.owner.get(request_id)
        return False if index is None else await self.replicas[index].abort(request_id)


def _ids(prompt: Prompt | TokenizedPrompt) -> list[int]:
    """The prompt's token ids for routing ([] for what the replica will refuse as malformed)."""
    if isinstance(prompt, TokenizedPrompt):
        return prompt.token_ids
    if isinstance(prompt, (list, tuple)) and all(type(t) is int for t in prompt):
        return list(prompt)
    return []


async def start_engine(config: EngineConfig) -> AsyncEngine | DataParallelEngine:
    """The served engine: one AsyncEngine, or data_parallel_size replicas behind a DataParallelEngine."""
    if config.data_parallel_size > 1:
        return await DataParallelEngine.start(config)
    return await AsyncEngine.start(config)
