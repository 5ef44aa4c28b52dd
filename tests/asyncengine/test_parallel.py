"""Pipeline and tensor parallelism end to end: greedy tokens equal HF's (= P=T=1's) for every
architecture with P=2 x T=2 and P=3, and with P=2 and T=2 alone for both model families (Llama-style
layers pass hidden states + residual between stages, GPT-2 only hidden states); a killed worker fails
requests instead of hanging; two nodes on loopback (a head engine and a `worker` launcher process)
with CURVE keys.

Every engine here starts 2-4 worker processes (seconds each on two cores), so each test combines its
checks in one engine, uses few tokens and one torch thread per worker. P=2 x T=2 runs every code path
of P=2 and of T=2 (TP groups inside stages, stage links between them) for each architecture, so
those two alone run for one architecture of each family only.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from tiny_models import ARCHITECTURES, hf_greedy

from asyncengine import LLM, AsyncEngine, EngineConfig, SamplingParams
from asyncengine.block_manager import BlockManager
from asyncengine.errors import EngineDeadError
from asyncengine.scheduler import Scheduler
from asyncengine.sequence import Sequence

pytestmark = pytest.mark.timeout(180)

PROMPT_LENGTHS = (3, 9, 17, 30, 41)
MAX_NEW = 5
# one model per architecture, each with a twist that parallelism must get right
MODEL_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": 1},  # T=2 replicates the single KV head
    "mistral": {},
    "qwen2": {},
    "qwen3": {"tie_word_embeddings": True},  # the last stage's LM head is the first stage's embedding
    "gpt2": {"num_hidden_layers": 5, "vocab_size": 509},  # 5 layers over 3 stages; vocab not divisible by 2
}
LAYOUTS: dict[str, dict[str, Any]] = {
    "pp2": {"pipeline_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
    "pp2xtp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    "pp3": {"pipeline_parallel_size": 3},  # 4 layers: 2/1/1; gpt2 (5 layers): an explicit 1/3/1
}


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def model_for(arch: str, factory: Any) -> Path:
    overrides = {"num_hidden_layers": 4, **MODEL_OVERRIDES[arch]}
    return factory(arch, **overrides)


@pytest.fixture(scope="module")
def expected() -> Any:
    cache: dict[Path, list[list[int]]] = {}

    def get(model: Path, prompts: list[list[int]]) -> list[list[int]]:
        if model not in cache:
            cache[model] = hf_greedy(model, prompts, MAX_NEW)
        return cache[model]

    return get


def track_in_flight(llm: LLM) -> list[int]:
    """Records how many batches were already in flight each time the engine sent one."""
    depths: list[int] = []
    executor, engine = llm.engine.executor, llm.engine
    send = executor.send

    def recording_send(message: Any) -> int:
        depths.append(len(engine._in_flight))
        return send(message)

    executor.send = recording_send  # type: ignore[method-assign]
    return depths


def test_scheduler_gives_each_pipeline_batch_its_share() -> None:
    """P=2: the first batch must not take every sequence, or the second stage idles."""
    sched = Scheduler(
        BlockManager(num_blocks=64, block_size=4),
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=64,
        num_batches=2,
    )
    seqs = [Sequence(i, 0, [5, 6, 7], SamplingParams(max_tokens=4), 4, i) for i in range(7)]
    for s in seqs:
        sched.add(s)
    a, b = sched.schedule(), sched.schedule()
    assert [len(a.scheduled), len(b.scheduled)] == [4, 3]  # ceil(7 / 2), then the rest
    assert not {s.seq_id for s, *_ in a.scheduled} & {s.seq_id for s, *_ in b.scheduled}
    assert sched.schedule().scheduled == []  # everything is in flight
    for s, n, samples in a.scheduled:
        sched.on_step_done(s, n, samples)
        s.token_ids.append(9)
    again = sched.schedule()
    assert [s.seq_id for s, *_ in again.scheduled] == [s.seq_id for s, *_ in a.scheduled]

    # ... and half the token budget, so a burst of prompts reaches the second stage sooner
    sched = Scheduler(
        BlockManager(num_blocks=64, block_size=4),
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=256,
        num_batches=2,
    )
    sched.add(Sequence(99, 0, list(range(100)), SamplingParams(max_tokens=4), 4, 99))
    assert [n for _, n, _ in sched.schedule().scheduled] == [32]


CASES = [(arch, layout) for arch in ARCHITECTURES for layout in ("pp2xtp2", "pp3")]
CASES += [(arch, layout) for arch in ("llama", "gpt2") for layout in ("pp2", "tp2")]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "layout"), CASES, ids=[f"{a}-{lay}" for a, lay in CASES])
def test_parallel_greedy_matches_single_process(
    arch, layout, tiny_model_factory, llm_factory, expected
) -> None:
    model = model_for(arch, tiny_model_factory)
    vocab = MODEL_OVERRIDES[arch].get("vocab_size", 512)
    prompts = make_prompts(vocab)
    parallel = dict(LAYOUTS[layout])
    if layout == "pp3" and arch == "gpt2":
        parallel["pp_layer_partition"] = (1, 3, 1)
    # a 16-token budget chunks every long prompt, so P batches of disjoint sequences are in flight
    llm = llm_factory(
        model,
        num_threads=1,
        max_num_batched_tokens=16,
        block_size=8,
        num_kv_blocks=64,
        max_model_len=128,
        **parallel,
    )
    depths = track_in_flight(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected(model, prompts)
    pp = parallel.get("pipeline_parallel_size", 1)
    # the pipeline was full: P batches in flight at once (one stage: async scheduling's 2 or 1)
    assert max(depths) == llm.engine.max_in_flight - 1
    assert pp == 1 or llm.engine.max_in_flight == pp
    assert len(llm.engine.executor.procs) == pp * parallel.get("tensor_parallel_size", 1)
    procs = llm.engine.executor.procs
    llm.shutdown()
    assert all(p.poll() is not None for p in procs)


def alive(pids: list[int]) -> list[int]:
    """The pids that still run (a zombie waiting for its reaper counts as gone)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.append(pid)
    return out


@pytest.mark.slow
async def test_killed_worker_fails_requests_within_seconds(tiny_model_factory) -> None:
    """SIGKILL stage 0 mid-generation (stage 1 is then stuck in a receive that nothing will answer)."""
    model = model_for("llama", tiny_model_factory)
    engine = await AsyncEngine.start(
        EngineConfig(
            model=str(model),
            dtype="float32",
            pipeline_parallel_size=2,
            num_threads=1,
            num_kv_blocks=256,
            block_size=8,
        )
    )
    procs = list(engine.executor.procs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        first_token = asyncio.Event()

        async def consume(prompt: list[int]) -> None:
            async for _ in engine.generate(prompt, params):
                first_token.set()

        tasks = [asyncio.create_task(consume(p)) for p in make_prompts(512)]
        await asyncio.wait_for(first_token.wait(), 60)
        os.kill(procs[0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
        elapsed = time.monotonic() - killed_at
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert elapsed < 5, f"requests failed {elapsed:.1f}s after the kill"
        with pytest.raises(EngineDeadError):
            engine.add_request([5, 6, 7], params)
    finally:
        await engine.shutdown()
    assert all(p.poll() is not None for p in procs)
    assert not alive([p.pid for p in procs])


# -- several nodes on loopback -------------------------------------------------------------------------


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the head's broadcast and result ports)."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port pair")


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (no psutil here)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def test_multi_node_config_errors_are_typed(tiny_model_factory, tmp_path) -> None:
    from asyncengine import ConfigError
    from asyncengine.executor import Executor

    model = str(model_for("llama", tiny_model_factory))
    with pytest.raises(ConfigError, match="head_port and key_file"):
        EngineConfig(model=model, pipeline_parallel_size=2, nnodes=2)
    with pytest.raises(ConfigError, match="divide the world size"):
        EngineConfig(model=model, pipeline_parallel_size=3, nnodes=2, head_port=9000, key_file="k")
    import socket

    with socket.socket() as taken:  # the broadcast port is in use: a ConfigError, nothing left running
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = EngineConfig(
            model=model,
            pipeline_parallel_size=2,
            nnodes=2,
            head_port=port,
            key_file=str(tmp_path / "keys.json"),
        )
        with pytest.raises(ConfigError, match="cannot set up"):
            Executor(config)


def test_worker_launcher_rejects_bad_arguments(tmp_path) -> None:
    from asyncengine.entrypoints.worker_cli import main, parse_head

    assert parse_head("10.0.0.1:29600") == ("10.0.0.1", 29600)
    assert parse_head("[::1]:7") == ("::1", 7)
    for bad in ("10.0.0.1", ":80", "host:http", "host:65535"):
        with pytest.raises(ValueError):
            parse_head(bad)
    (tmp_path / "keys.json").write_text("not json")
    assert main(["--head", "127.0.0.1:9", "--node-rank", "1", "--key-file", str(tmp_path / "keys.json")]) == 2
    assert main(["--head", "nohost", "--node-rank", "1", "--key-file", str(tmp_path / "keys.json")]) == 2


@pytest.mark.slow
def test_two_nodes_on_loopback(tiny_model_factory, expected, tmp_path) -> None:
    """Head: an engine with nnodes=2 running node 0's rank; node 1: `asyncengine worker` in another
    process. Greedy equals single-process; killing node 1 fails requests; nothing is left behind."""
    model = model_for("mistral", tiny_model_factory)
    prompts = make_prompts(512)
    port, key_file = free_port_pair(), tmp_path / "keys.json"
    box: dict[str, Any] = {}

    def start_head() -> None:
        try:
            box["llm"] = LLM(
                model=str(model),
                dtype="float32",
                pipeline_parallel_size=2,
                num_threads=1,
                num_kv_blocks=64,
                block_size=8,
                max_model_len=128,
                max_num_batched_tokens=16,
                nnodes=2,
                head_port=port,
                key_file=str(key_file),
            )
        except BaseException as e:  # surfaced by the main thread
            box["error"] = e

    head = threading.Thread(target=start_head)
    head.start()
    launcher = None
    try:
        deadline = time.monotonic() + 60
        while not key_file.exists() and head.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert key_file.exists(), box.get("error")
        assert key_file.stat().st_mode & 0o777 == 0o600
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "asyncengine.entrypoints.worker_cli",
                "--head",
                f"127.0.0.1:{port}",
                "--node-rank",
                "1",
                "--key-file",
                str(key_file),
                "--nproc",
                "1",
            ],
            stdin=subprocess.DEVNULL,
        )
        head.join(120)
        assert "llm" in box, box.get("error")
        llm: LLM = box["llm"]
        assert llm.engine.executor.endpoints.broadcast == f"tcp://127.0.0.1:{port}"
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected(model, prompts)

        # node 1 dies: its worker's connection drops and the head fails requests at once
        local = {p.pid for p in llm.engine.executor.procs}
        remote = [
            pid for pid in processes_mentioning(f"127.0.0.1:{port}") if pid not in local | {launcher.pid}
        ]
        assert len(local) == 1 and len(remote) == 1  # one rank per node
        launcher.kill()
        launcher.wait(5)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        assert time.monotonic() - t0 < 10
        procs = llm.engine.executor.procs
        llm.shutdown()
        assert all(p.poll() is not None for p in procs)
        deadline = time.monotonic() + 10  # the orphaned worker sees its death pipe close
        while alive(remote) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(remote)
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        head.join(30)
        if "llm" in box:
            box["llm"].shutdown()
        for pid in processes_mentioning(f"127.0.0.1:{port}"):
            os.kill(pid, signal.SIGKILL)
