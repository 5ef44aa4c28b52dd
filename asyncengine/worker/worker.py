"""Worker: one per device. All communication lives here; the ModelRunner only computes.

execute_model = prepare_worker_input -> execute_worker -> model_runner.prepare_model_input
                -> receive IntermediateTensors (stages > 0) -> model_runner.execute_model
                -> send IntermediateTensors (stages < last) or return the ModelOutput (last stage).
"""

from __future__ import annotations

import logging
import time

import msgspec
import torch

from asyncengine.config import EngineConfig, layer_range
from asyncengine.cuda.device import bind_device, dist_backend
from asyncengine.cuda.memory import profile_and_size, size_kv_cache_cpu
from asyncengine.layers.attention import set_attention_backend
from asyncengine.layers.attention_selector import make_attention_backend
from asyncengine.layers.parallel import ParallelContext
from asyncengine.layers.sampler import SamplerOutput
from asyncengine.models.loader import get_model_config, lm_head_cost, model_dtype, model_max_len
from asyncengine.transport.process_group import Topology, destroy_process_groups, init_process_groups
from asyncengine.transport.stage_link import StageLink
from asyncengine.transport.wire import ExecuteModelRequest, InitWorker, ModelOutput, pack_ids
from asyncengine.worker.input_batch import InputBatch, StepBatch
from asyncengine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    dtype = model_dtype(get_model_config(config.model))
    if device.type == "cpu" and dtype == torch.float16:
        return torch.bfloat16  # half-precision matmuls are slow on most CPUs; bf16 is well supported
    return dtype


class Worker:
    def __init__(
        self,
        rank: int,
        init: InitWorker,
        local_rank: int | None = None,
        device_id: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        self.config = config = msgspec.json.decode(init.config_json, type=EngineConfig)
        self.topology = Topology(rank, config.pipeline_parallel_size, config.tensor_parallel_size)
        local = rank % config.nproc_per_node if local_rank is None else local_rank
        # a CPU worker shares this node's cores with the node's other workers only (or uses the cores its
        # Ray bundle reserved: num_threads)
        threads = config.num_threads if num_threads is None else num_threads
        self.device = bind_device(config.device, local, config.nproc_per_node, threads, device_id)
        groups = init_process_groups(self.topology, init.dist_init_method, dist_backend(self.device))
        hf_config = get_model_config(config.model)
        num_layers = getattr(hf_config, "num_hidden_layers", None) or hf_config.n_layer
        start, end = layer_range(
            num_layers,
            self.topology.pp_rank,
            self.topology.pp_size,
            config.pp_layer_partition,
            head_cost=lm_head_cost(hf_config),
        )
        self.parallel = ParallelContext(
            tp_rank=self.topology.tp_rank,
            tp_size=self.topology.tp_size,
            pp_rank=self.topology.pp_rank,
            pp_size=self.topology.pp_size,
            layer_start=start,
            layer_end=end,
            tp_group=groups.tp_group,
        )
        self.dtype = resolve_dtype(config, self.device)
        set_attention_backend(make_attention_backend(config.attention_backend, self.device))
        limit = model_max_len(hf_config)
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.model_runner = ModelRunner(
            config, self.parallel, self.device, self.dtype, self.max_model_len, progress=rank == 0
        )
        self.vocab_size = int(getattr(hf_config, "vocab_size", 0))
        self.input_batch = InputBatch(self.device, self.vocab_size)
        self.link = StageLink(self.topology.prev_stage_rank, self.topology.next_stage_rank, self.device)
        # async scheduling: the engine schedules a sequence's next step before it has seen this step's
        # token, so every rank of the (single) stage samples, identically, and appends it itself
        self.appends_samples = config.run_ahead

    # -- start-up ---------------------------------------------------------------------------------
    def num_kv_blocks_that_fit(self) -> int:
        """Sizes the KV cache: the configured count, or what fits after a profiled forward (GPU) or in
        the byte budget (CPU). Raises KVCacheTooSmallError when one max_model_len sequence won't fit."""
        cfg, per_block = self.config, self.model_runner.kv_bytes_per_block
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type == "cuda":
            return profile_and_size(
                self.model_runner.profile_run,
                per_block,
                cfg.gpu_memory_utilization,
                block_size=cfg.block_size,
                max_model_len=self.max_model_len,
                device=self.device,
            )
        return size_kv_cache_cpu(per_block, cfg.block_size, self.max_model_len, cfg.kv_cache_memory_bytes)

    def init_cache(self, num_blocks: int) -> None:
        self.model_runner.init_cache(num_blocks)
        self.model_runner.capture_graphs()

    # -- the step ---------------------------------------------------------------------------------
    def prepare_worker_input(self, req: ExecuteModelRequest) -> StepBatch:
        return self.input_batch.update(req)

    def execute_worker(self, batch: StepBatch) -> None:
        """Cache operations before the forward pass. Blocks are never shared while being written
        (prefix caching only shares full, computed blocks), so there is nothing to copy or swap."""

    def execute_model(self, req: ExecuteModelRequest) -> ModelOutput | None:
        t0 = time.perf_counter()
        batch = self.prepare_worker_input(req)
        self.execute_worker(batch)
        if not batch.seqs:
            return ModelOutput(req.step_id, b"") if self.topology.is_driver else None
        model_input = self.model_runner.prepare_model_input(batch)
        intermediate = None
        if not self.parallel.is_first_stage:
            model = self.model_runner.model
            intermediate = self.link.recv(
                model.intermediate_names, batch.num_tokens, model.hidden_size, self.dtype
            )
        sample = self.topology.is_driver or self.appends_samples
        grammar = (req.grammar_seq_ids, req.grammar_bitmask) if req.grammar_seq_ids else None
        out = self.model_runner.execute_model(model_input, intermediate, sample=sample, grammar=grammar)
        self.input_batch.mark_computed(batch)
        if self.appends_samples:
            assert isinstance(out, SamplerOutput)
            for state, token in zip(model_input.sampling_seqs, out.token_ids):
                state.append([token])
        if not self.parallel.is_last_stage:
            assert isinstance(out, dict)
            self.link.send(out)
            return None
        if not self.topology.is_driver:
            return None
        assert isinstance(out, SamplerOutput)
        return ModelOutput(
            step_id=req.step_id,
            sampled_token_ids=pack_ids(out.token_ids),
            logprobs=out.logprobs or [],
            execute_us=int((time.perf_counter() - t0) * 1e6),
        )

    def close(self) -> None:
        self.model_runner.close()
        self.link.wait_sent()
        destroy_process_groups()
