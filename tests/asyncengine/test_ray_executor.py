"""The "ray" executor backend on a local Ray instance: greedy output equal to mp's and HF's at PP=2, TP=2
and PP=2 x TP=2; a SIGKILLed actor or worker fails the stream within 5 s and leaves nothing running; an
impossible placement is a ConfigError within its timeout; an engine that starts its own Ray stops it.

One Ray instance (4 CPUs declared on this 2-core machine) serves the module; each engine's placement
group and actors are checked gone after it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tiny_models import hf_greedy

from asyncengine import LLM, AsyncEngine, EngineConfig, SamplingParams
from asyncengine.errors import ConfigError, EngineDeadError

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow, pytest.mark.ray]

PROMPTS = [[5, 9, 2, 44, 17], [3, 8], [100, 200, 300, 400, 12, 13, 14, 15, 16, 17, 18]]  # vocab 512
MAX_NEW = 6
LAYOUTS = {
    "pp2": {"pipeline_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
    "pp2xtp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
}
DEATH_BOUND_S = 5.0


@pytest.fixture(scope="module")
def local_ray() -> Any:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:  # noqa: ANN001
    return tiny_model_factory("llama", tokenizer=True, num_hidden_layers=4, num_key_value_heads=1)


def pid_alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def live_groups() -> list[str]:
    table = ray.util.placement_group_table()
    return [pg_id for pg_id, info in table.items() if info["state"] != "REMOVED"]


def config(model: Path, **kw: Any) -> EngineConfig:
    base = {
        "model": str(model),
        "dtype": "float32",
        "num_kv_blocks": 64,
        "num_threads": 1,
        "distributed_executor_backend": "ray",
    }
    return EngineConfig(**{**base, **kw})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ray_greedy_equals_mp_equals_hf(layout: str, local_ray, model: Path) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    want = hf_greedy(model, PROMPTS, MAX_NEW)
    got = {}
    for backend in ("ray", "mp"):
        llm = LLM(
            model=str(model),
            dtype="float32",
            num_kv_blocks=64,
            num_threads=1,
            distributed_executor_backend=backend,
            **LAYOUTS[layout],
        )
        try:
            pids = llm.engine.executor.worker_pids
            got[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        finally:
            llm.shutdown()
        assert len(pids) == llm.engine.config.world_size
        assert not [p for p in pids if pid_alive(p)], f"{backend} left workers running"
    assert got["ray"] == got["mp"] == want
    assert not live_groups()


async def _kill_mid_stream(model: Path, victim: str) -> None:
    # room for 4000 tokens: the stream cannot end before the death is seen, however fast the machine
    engine = await AsyncEngine.start(config(model, pipeline_parallel_size=2, num_kv_blocks=260))
    workers = engine.executor.worker_pids
    hosts = [parent_pid(p) for p in workers]  # each worker's parent is its actor's process
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
        stream = engine.generate([1, 2, 3], params, request_id="long")
        first = await stream.__anext__()
        assert first.outputs[0].token_ids
        killed_at = time.monotonic()
        os.kill(hosts[1] if victim == "actor" else workers[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                assert time.monotonic() - killed_at < DEATH_BOUND_S + 5
        elapsed = time.monotonic() - killed_at
        print(f"SIGKILL of a {victim}: EngineDeadError after {elapsed:.2f}s")
        assert elapsed < DEATH_BOUND_S, elapsed
        assert not engine.is_running
    finally:
        await engine.shutdown()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [p for p in workers + hosts if pid_alive(p)]:
        await asyncio.sleep(0.1)
    assert not [p for p in workers + hosts if pid_alive(p)], "an actor or worker survived"
    assert not live_groups()


@pytest.mark.parametrize("victim", ["actor", "worker"])
def test_sigkill_mid_stream_fails_fast_and_leaves_nothing(victim: str, local_ray, tiny_model_factory) -> None:  # noqa: ANN001
    model = tiny_model_factory("llama", num_hidden_layers=2, max_position_embeddings=4096)
    asyncio.run(_kill_mid_stream(model, victim))


def test_impossible_placement_is_a_config_error_within_the_timeout(local_ray, model: Path) -> None:  # noqa: ANN001
    async def run() -> None:
        with pytest.raises(ConfigError, match=r"missing CPU: 4") as info:
            await AsyncEngine.start(config(model, tensor_parallel_size=8, ray_placement_timeout=2.0))
        print(info.value)

    started = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - started < 2.0 + 5.0
    assert not live_groups()


def test_engine_started_ray_is_stopped_at_exit(model: Path, tmp_path: Path) -> None:
    """`asyncengine generate` with no Ray running and no RAY_ADDRESS: it starts a local Ray instance for
    itself and leaves no Ray process (nor worker) behind."""
    before = ray_processes()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncengine",
            "generate",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "64",
            "-pp",
            "2",
            "--distributed-executor-backend",
            "ray",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--temperature",
            "0",
            "hello world",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and ray_processes() - before:
        time.sleep(0.2)
    left = ray_processes() - before
    assert not left, f"left running: {left}"


def ray_processes() -> set[tuple[int, str]]:
    """(pid, command) of every live process that belongs to Ray or is an asyncengine worker."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not pid_alive(int(entry.name)):
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (
            "ray" in cmd and ("raylet" in cmd or "gcs_server" in cmd or "ray::" in cmd or "/ray/" in cmd)
        ) or ("asyncengine.worker.main" in cmd):
            found.add((int(entry.name), cmd[:120]))
    return found


def test_cuda_index_binds_the_physical_gpu() -> None:
    """Ray's GPU id is an entry of the node's CUDA_VISIBLE_DEVICES when set, a physical index when not."""
    from asyncengine.ray_worker_host import cuda_index

    assert cuda_index("3", None) == 3
    assert cuda_index("3", "") == 3
    assert cuda_index("6", "4,5,6,7") == 2
    assert cuda_index("GPU-abc", "GPU-xyz, GPU-abc") == 1
    with pytest.raises(ValueError, match="not in CUDA_VISIBLE_DEVICES"):
        cuda_index("1", "4,5")


def test_data_parallel_replicas_on_ray(local_ray, model: Path) -> None:  # noqa: ANN001
    """-dp 2 with ray: each replica its own placement group; both serve; nothing is left after."""
    from asyncengine.dp_engine import DataParallelEngine, start_engine

    prompts = PROMPTS * 2

    async def run() -> list[list[int]]:
        engine = await start_engine(config(model, data_parallel_size=2))
        assert isinstance(engine, DataParallelEngine)
        try:
            assert len(live_groups()) == 2
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

            async def one(p: list[int]) -> list[int]:
                return [o async for o in engine.generate(p, params)][-1].outputs[0].token_ids

            got = await asyncio.gather(*(one(p) for p in prompts))
            assert all(n > 0 for n in engine.routed), engine.routed
            return got
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == hf_greedy(model, PROMPTS, MAX_NEW) * 2
    assert not live_groups()
    assert ray.is_initialized()  # the test's own Ray is left alone
