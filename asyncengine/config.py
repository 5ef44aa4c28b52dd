"""EngineConfig: the one frozen config. CLI flags and ASYNCENGINE_* variables are generated from its
fields."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from asyncengine.device_probe import resolved_device
from asyncengine.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "fp8_e5m2")
LM_HEAD_QUANTIZATIONS = ("int8", "int4")
EXECUTOR_BACKENDS = ("mp", "ray")
# KV-cache block sizes where --block-size is not given. On a CPU a decode row's keys stream from DRAM one
# block at a time: longer contiguous runs and fewer per-block steps of the online softmax read faster
# (bench/decode_step.py --block-sizes 16 64, batch 64 x 256 keys on an AMD EPYC: the attention kernel
# float32 38.3 -> 25.7 ms a step, bfloat16 20.7 -> 16.0-18.0; vLLM's CPU backend uses 128). Prefix
# caching shares whole blocks, so 64 rather than 128. CUDA keeps vLLM's 16.
CPU_BLOCK_SIZE = 64
CUDA_BLOCK_SIZE = 16


def default_model_path() -> str:
    """The bundled default model (see tools/train_default_model.py)."""
    return str(Path(__file__).parent / "assets" / "default-model")


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # Hugging Face Hub repo ids: "Qwen/Qwen2-0.5B"


def model_not_found(model: str) -> str:
    """The error for a --model that is not a directory; for what looks like a Hub id, how to get it."""
    message = f"model directory not found: {model}"
    if HUB_ID.fullmatch(model) and not Path(model).exists():
        local = "./" + model.rsplit("/", 1)[1]
        message += (
            f". Only local model directories are served, not Hugging Face Hub ids: download it first, "
            f"e.g. `huggingface-cli download {model} --local-dir {local}` (or `hf download {model} "
            f"--local-dir {local}`), then pass --model {local}"
        )
    return message


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(default_factory=default_model_path, metadata={"help": "HuggingFace model directory"})
    tokenizer: str | None = field(
        default=None, metadata={"help": "tokenizer directory (default: the model's)"}
    )
    dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16 | float16"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    pipeline_parallel_size: int = field(default=1, metadata={"help": "pipeline stages", "short": "-pp"})
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "tensor-parallel ranks per stage", "short": "-tp"}
    )
    pp_layer_partition: tuple[int, ...] | None = field(
        default=None, metadata={"help": "layers per stage, e.g. 3,2 (default: even split)"}
    )
    block_size: int | None = field(
        default=None,
        metadata={
            "help": f"tokens per KV-cache block (default: {CPU_BLOCK_SIZE} on a CPU, "
            f"{CUDA_BLOCK_SIZE} on CUDA)"
        },
    )
    quantization: str | None = field(
        default=None,
        metadata={
            "help": "int8 | int4: quantize an unquantized checkpoint's linear layers at load time "
            "(weight-only). int8: per output channel, about half of bfloat16's weight bytes; int4: a scale "
            "and minimum per output channel and 32 inputs (round-to-nearest, llama.cpp's Q4_1 blocks), "
            "about 0.38x. Quantized checkpoints (GPTQ, AWQ, FP8, compressed-tensors) are read from their "
            "config.json without this flag"
        },
    )
    lm_head_quantization: str | None = field(
        default=None,
        metadata={
            "help": "int8 | int4: also quantize the LM head (the logits GEMM) at load time, as llama.cpp "
            "does its output tensor; any checkpoint, quantized or not. int8: per vocabulary row; int4: a "
            "scale and minimum per row and 32 hidden columns. Off by default (as in vLLM): int8 moves "
            "logits by about half a percent of their range, int4 by about 5%"
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (the model's dtype) | fp8_e5m2 (half the KV bytes of bfloat16, K/V rounded to 2 "
            "mantissa bits; output no longer matches the model's dtype token for token)"
        },
    )
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "KV blocks (default: size from memory)"}
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata={"help": "KV-cache bytes per worker on CPU (default: 1/4 of free RAM, max 4 GiB)"},
    )
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "share of GPU memory to use"})
    max_num_seqs: int = field(default=256, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(
        default=2048,
        metadata={"help": "token budget of one step (with -pp P: of the whole pipeline, 1/P per batch)"},
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "context length (default: the model's)"}
    )
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prefixes"})
    seed: int = field(default=0, metadata={"help": "seed of unseeded sampling"})
    enforce_eager: bool = field(
        default=False, metadata={"help": "never capture CUDA graphs (nor CPU kernel graphs)"}
    )
    cuda_graph_sizes: tuple[int, ...] | None = field(
        default=None, metadata={"help": "decode batch sizes to capture"}
    )
    attention_backend: str = field(default="auto", metadata={"help": "auto | torch | cpu | triton"})
    async_scheduling: bool = field(
        default=True, metadata={"help": "schedule step N+1 while step N runs (single pipeline stage)"}
    )
    num_speculative_tokens: int = field(
        default=0,
        metadata={
            "help": "speculative decoding: draft tokens per step from n-gram prompt lookup, verified in the "
            "same step (0: off; greedy requests only; turns async scheduling off)"
        },
    )
    prompt_lookup_max: int = field(default=3, metadata={"help": "longest n-gram the drafts are looked up by"})
    prompt_lookup_min: int = field(
        default=1, metadata={"help": "shortest n-gram the drafts are looked up by"}
    )
    spec_token_budget: int = field(
        default=128,
        metadata={
            "help": "rows a step verifies (one per decoding sequence plus drafts) beyond which drafts are "
            "cut: each sequence gets min(num_speculative_tokens, (budget - sequences) // sequences); "
            "0: no limit"
        },
    )
    step_timeout: float = field(
        default=60.0, metadata={"help": "seconds a step may take before workers are dead"}
    )
    heartbeat_timeout: float = field(
        default=5.0,
        metadata={
            "help": "seconds a worker may leave the engine's heartbeat pings unanswered (frozen, or its node "
            "gone) before the engine is dead, busy or idle; ZeroMQ's I/O thread answers them, so a long "
            "step does not count"
        },
    )
    num_threads: int | None = field(default=None, metadata={"help": "torch threads per CPU worker"})
    nnodes: int = field(
        default=1,
        metadata={
            "help": "nodes running workers; above 1 the head listens on TCP with CURVE and each other node "
            "runs `asyncengine worker --head HEAD_HOST:HEAD_PORT --node-rank N --key-file F`"
        },
    )
    head_host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "address the head binds for other nodes (ZeroMQ and the torch.distributed rendezvous)"
        },
    )
    head_port: int | None = field(
        default=None,
        metadata={"help": "with nnodes > 1: TCP port of the step broadcast; results use head_port + 1"},
    )
    key_file: str | None = field(
        default=None,
        metadata={
            "help": "with nnodes > 1: where the head writes the CURVE key file (0600) to copy to the other "
            "nodes"
        },
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata={
            "help": "mp: workers are subprocesses of the engine (other nodes' started by `asyncengine "
            "worker`) | ray: one Ray actor per rank hosts it, placed by a placement group "
            "(pip install 'asyncengine[ray]')"
        },
    )
    data_parallel_size: int = field(
        default=1,
        metadata={
            "help": "independent engine replicas (each with its own workers and KV cache, each PP x TP) "
            "behind one server; requests go to the least loaded, or where their prefix was served",
            "short": "-dp",
        },
    )
    ray_address: str | None = field(
        default=None,
        metadata={
            "help": "with ray: the cluster to join (default: RAY_ADDRESS; without it a local Ray instance "
            "is started, and stopped at shutdown)"
        },
    )
    ray_placement_timeout: float = field(
        default=60.0,
        metadata={"help": "with ray: seconds to wait for the placement group before a ConfigError"},
    )

    def __post_init__(self) -> None:
        if self.block_size is None:  # fixed here, once: the workers get this config with the number in it
            device = resolved_device(self.device) if self.device in DEVICES else "cpu"
            object.__setattr__(self, "block_size", CUDA_BLOCK_SIZE if device == "cuda" else CPU_BLOCK_SIZE)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.lm_head_quantization not in (None, *LM_HEAD_QUANTIZATIONS):
            raise ConfigError(
                f"lm_head_quantization must be one of {LM_HEAD_QUANTIZATIONS} (or unset), "
                f"got {self.lm_head_quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {DEVICES}, got {self.device!r}")
        for name in (
            "pipeline_parallel_size",
            "tensor_parallel_size",
            "data_parallel_size",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.pp_layer_partition is not None:
            if len(self.pp_layer_partition) != self.pipeline_parallel_size:
                raise ConfigError("pp_layer_partition needs one entry per pipeline stage")
            if any(n < 1 for n in self.pp_layer_partition):
                raise ConfigError("every pipeline stage needs at least one layer")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ConfigError(
                f"attention_backend must be auto, torch, cpu or triton, got {self.attention_backend!r}"
            )
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ConfigError(
                f"nnodes must be >= 1 and divide the world size {self.world_size}, got {self.nnodes}"
            )
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ConfigError(
                "nnodes is for hand-started nodes (the mp backend); Ray places the ranks itself"
            )
        if not 0 < self.ray_placement_timeout <= 86400:
            raise ConfigError(
                f"ray_placement_timeout must be in (0, 86400] seconds, got {self.ray_placement_timeout}"
            )
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ConfigError("data_parallel_size > 1 needs the ray backend to span nodes, not nnodes")
        if self.nnodes > 1 and (self.head_port is None or self.key_file is None):
            raise ConfigError("nnodes > 1 needs head_port and key_file")
        if self.head_port is not None and not 0 < self.head_port < 65535:
            raise ConfigError(
                f"head_port must be in [1, 65534] (results use head_port + 1), got {self.head_port}"
            )
        if not 0.1 <= self.heartbeat_timeout <= 3600:
            raise ConfigError(
                f"heartbeat_timeout must be in [0.1, 3600] seconds, got {self.heartbeat_timeout}"
            )
        if self.spec_token_budget < 0:
            raise ConfigError(f"spec_token_budget must be >= 0, got {self.spec_token_budget}")
        if self.num_speculative_tokens < 0:
            raise ConfigError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if not Path(self.model).is_dir():
            raise ConfigError(model_not_found(self.model))
        check_quantization(self.model, self.quantization)

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def run_ahead(self) -> bool:
        """Async scheduling in effect: a sequence's next step is scheduled before its token is known, which
        needs a single stage (the worker appends its own sample) and no drafts to verify first."""
        return self.async_scheduling and self.pipeline_parallel_size == 1 and not self.num_speculative_tokens

    @property
    def nproc_per_node(self) -> int:
        """Workers per node: node N holds ranks N * nproc_per_node .. (N + 1) * nproc_per_node - 1."""
        return self.world_size // self.nnodes

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def check_quantization(model: str, quantization: str | None) -> None:
    """ConfigError now, in the engine process, for a quantization the workers would refuse to load."""
    from asyncengine.quantization.config import parse_quant_config  # torch-free

    try:
        raw = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raw = {}  # the workers report an unreadable config.json
    parse_quant_config(raw.get("quantization_config") if isinstance(raw, dict) else None, quantization)


def layer_range(
    num_layers: int, pp_rank: int, pp_size: int, partition: tuple[int, ...] | None, head_cost: float = 0.0
) -> tuple[int, int]:
    """[start, end) of the decoder layers that pipeline stage `pp_rank` owns.

    Without an explicit partition the stages get equal work, counting the final norm + LM head +
    sampler that only the last stage runs as `head_cost` decoder layers (see `default_partition`)."""
    if partition is None:
        partition = default_partition(num_layers, pp_size, head_cost)
    if sum(partition) != num_layers:
        raise ConfigError(f"pp_layer_partition {partition} does not add up to {num_layers} layers")
    if any(n < 1 for n in partition):
        raise ConfigError(f"{pp_size} pipeline stages need at least {pp_size} layers, model has {num_layers}")
    start = sum(partition[:pp_rank])
    return start, start + partition[pp_rank]


def default_partition(num_layers: int, pp_size: int, head_cost: float = 0.0) -> tuple[int, ...]:
    """Layers per stage so that no stage is the pipeline's bottleneck: the last stage's layer count is
    chosen so the busiest stage (the last one counting head_cost) has the least work; the others share
    the rest evenly, remainder to the first ones. With head_cost 0 this is the plain even split.
    Example: a 12-layer model whose LM head costs 1.7 layers runs 7 + 5 on two stages, not 6 + 6 (which
    left stage 0 idle a third of the time in bench/pipeline.py)."""
    if pp_size < 1 or num_layers < pp_size:
        raise ConfigError(f"{pp_size} pipeline stages need at least {pp_size} layers, model has {num_layers}")
    if pp_size == 1:
        return (num_layers,)

    def split(last: int) -> tuple[int, ...]:
        base, extra = divmod(num_layers - last, pp_size - 1)
        return (*(base + (1 if i < extra else 0) for i in range(pp_size - 1)), last)

    def badness(
        last: int,
    ) -> tuple[float, float, int]:  # bottleneck stage, then spread, then fewer on the last
        costs = [*split(last)[:-1], last + head_cost]
        return max(costs), max(costs) - min(costs), last

    return split(min(range(1, num_layers - pp_size + 2), key=badness))
