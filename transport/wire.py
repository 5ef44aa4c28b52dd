"""Every message that crosses a process boundary, as msgspec Structs (msgpack). No pickle anywhere.

Engine -> workers: one tagged union, `EngineMessage` (the step message and the control messages).
Workers -> engine: one tagged union, `WorkerMessage`.
Every member of a union is array_like (no field names on the wire; msgspec needs them alike);
hot-path Structs are also omit_defaults and gc=False.
Token-id lists that can be long (prompts) travel as packed little-endian int32 bytes.
"""

from __future__ import annotations

from array import array

import msgspec

HOT = dict(array_like=True, omit_defaults=True, gc=False)


def pack_ids(ids: list[int]) -> bytes:
    """Packs token ids as int32; several times faster to decode than a msgpack list of ints."""
    return array("i", ids).tobytes()


def unpack_ids(data: bytes) -> list[int]:
    out = array("i")
    out.frombytes(data)
    return out.tolist()


class SamplingOptions(msgspec.Struct, **HOT):
    """The part of SamplingParams that the sampler on the worker needs."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    min_tokens: int = 0
    min_tokens_banned_ids: list[int] = []  # EOS and stop ids, masked until min_tokens are generated


class NewSeq(msgspec.Struct, **HOT):
    """A sequence the workers have not seen (or must recompute after preemption): sent once."""

    seq_id: int
    token_ids: bytes  # packed int32: prompt plus any tokens already generated (recompute)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already cached (prefix-cache hit)
    num_scheduled_tokens: int
    sampling: SamplingOptions


class CachedSeq(msgspec.Struct, **HOT):
    """A diff for a sequence the workers already hold."""

    seq_id: int
    num_scheduled_tokens: int
    new_token_ids: list[int] = []  # tokens appended since its last step (the one sampled then), then drafts
    new_block_ids: list[int] = []
    num_rejected: int = 0  # drop this many tokens (drafts the model rejected) before appending the new ones
    num_draft_tokens: int = 0  # the last ones of new_token_ids are drafts: sample after each of them too


class ExecuteModelRequest(msgspec.Struct, tag="step", **HOT):
    step_id: int
    new_seqs: list[NewSeq] = []
    cached_seqs: list[CachedSeq] = []
    finished_seq_ids: list[int] = []  # drop their state (finished, aborted or preempted)
    # structured output: the sequences whose sampled token is masked this step, and their masks, one row
    # each in that order, of little-endian int32 words (bit t of the row: token t is allowed)
    grammar_seq_ids: list[int] = []
    grammar_bitmask: bytes = b""


class InitWorker(msgspec.Struct, tag="init", array_like=True):
    """Load the model shard, profile, and answer WorkerReady with the KV blocks that fit."""

    config_json: bytes  # EngineConfig as JSON (msgspec), decoded by the worker against its type
    dist_init_method: str  # tcp://host:port rendezvous of torch.distributed
    world_size: int


class InitCache(msgspec.Struct, tag="init_cache", array_like=True):
    num_kv_blocks: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


EngineMessage = ExecuteModelRequest | InitWorker | InitCache | Shutdown


class TokenLogprobs(msgspec.Struct, **HOT):
    token_ids: list[int]  # the sampled token first, then the top-k
    logprobs: list[float]
    ranks: list[int] = []  # rank of each token in the full distribution (1 = most likely)


class ModelOutput(msgspec.Struct, tag="output", **HOT):
    """Sampled tokens of one step, in the order of the step's sequences that reached their end."""

    step_id: int
    sampled_token_ids: bytes  # packed int32
    logprobs: list[TokenLogprobs | None] = []  # one per sampled token when any sequence asked
    execute_us: int = 0  # worker-side compute time, for the benchmarks


class WorkerReady(msgspec.Struct, tag="ready", array_like=True):
    rank: int
    num_kv_blocks: int  # how many blocks fit on this worker
    pid: int
    vocab_size: int = 0


class CacheReady(msgspec.Struct, tag="cache_ready", array_like=True):
    rank: int


class WorkerFailure(msgspec.Struct, tag="failure", array_like=True):
    rank: int
    message: str
    step_id: int = -1
    error_type: str = ""  # the exception's class name, so start-up errors keep their type


WorkerMessage = ModelOutput | WorkerReady | CacheReady | WorkerFailure
