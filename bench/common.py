"""Helpers shared by the benchmark scripts: random models, seeded workloads, GEMM peak, FLOP counts,
tables, plots, machine facts, and subprocess handling that never leaves anything running.

Nothing here imports the engine, so the vLLM runner (another venv) could import it too.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import platform
import random
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
MODELS = OUT / "models"
VLLM_VENV = HERE / "vllm_venv"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"

# -- models -----------------------------------------------------------------------------------------
# Random Llamas (nothing downloaded). "null" is the near-null forward of the control-plane benchmark:
# hidden 8, two layers (so P=2 has a layer per stage), vocab 256 -> a step's model math is a few
# microseconds, the control plane dominates.
MODEL_SPECS: dict[str, dict[str, int]] = {
    "null": dict(
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=16,
        vocab_size=256,
        max_position_embeddings=4096,
    ),
    "tiny": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=32000,
        max_position_embeddings=1024,
    ),
    "medium": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=1024,
    ),
}
# medium's weights (same seed) with room for bench/sweep.py's 2048-token prompts + 512-token outputs
MODEL_SPECS["medium4k"] = {**MODEL_SPECS["medium"], "max_position_embeddings": 4096}
# bench/sweep.py --model: shapes other than medium's 12 x 64 full multi-head attention, so that the grid can
# be measured on grouped-query attention (Llama-3 style: 16 query heads over 4 KV heads) and on 128-wide
# heads (Qwen3 / Llama-3-8B style: 8 heads of 128 over 2 KV heads), ~150M matmul parameters each
MODEL_SPECS["gqa4k"] = dict(
    hidden_size=1024,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=2816,
    vocab_size=32000,
    max_position_embeddings=4096,
)
MODEL_SPECS["hd128-4k"] = {**MODEL_SPECS["gqa4k"], "num_attention_heads": 8, "num_key_value_heads": 2}
# Qwen2.5-0.5B's shape (~494M parameters): 24 layers of hidden 896, 14 heads of 64 over 2 KV heads (groups
# of 7), biased q/k/v, and a 151,936-token vocabulary tied to the embedding, so the LM head is a quarter of
# the matmul weights; context cut to 4,096 for the sweep's longest cell
MODEL_SPECS["qwen05"] = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=4096,
)
# Qwen3-0.6B's shape: 28 layers of hidden 1024, 16 heads of 128 (wider than hidden / heads) over 8 KV
# heads, an RMSNorm over each query and key head (qk-norm), a tied 151,936-token vocabulary
MODEL_SPECS["qwen3"] = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    max_position_embeddings=4096,
)
# GPT-2 small's shape (124M): learned positions, LayerNorm, biased projections, a 4x GELU MLP, a tied
# 50,257-token vocabulary; context 4,096 as medium4k's, for the sweep's longest cell
MODEL_SPECS["gpt2"] = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    intermediate_size=3072,
    vocab_size=50257,
    max_position_embeddings=4096,
)
# the HF family a spec is built as (default Llama: untied, no biases)
MODEL_FAMILIES: dict[str, str] = {"qwen05": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}
# per family: HF's config class, the architecture, and the options beside the spec (every family's models
# take bos 1 / eos 2); the Qwen ones tie the LM head to the embedding as the real models do
_QWEN_OPTIONS: dict[str, Any] = dict(tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6)
FAMILY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _QWEN_OPTIONS),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _QWEN_OPTIONS),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
}
# config.json names of GPT2Config's attributes (it maps the usual names onto them)
CONFIG_ALIASES = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "max_position_embeddings": "n_positions",
}


def build_model(name: str, root: Path = MODELS) -> Path:
    """Saves a seeded random model `name` (float32 safetensors; a Llama unless MODEL_FAMILIES says) under
    root/name, reused when there."""
    spec = MODEL_SPECS[name]
    path = root / name
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        saved = json.loads((path / "config.json").read_text())
        if all(saved.get(k, saved.get(CONFIG_ALIASES.get(k, k))) == v for k, v in spec.items()):
            return path  # else the spec changed: rebuild
    import torch
    import transformers

    torch.manual_seed(0)
    config_class, architecture, options = FAMILY_CONFIGS[MODEL_FAMILIES.get(name, "llama")]
    cfg = getattr(transformers, config_class)(**spec, bos_token_id=1, eos_token_id=2, **options)
    cfg.architectures = [architecture]
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)  # then renamed: a half-written model is never reused
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.replace(path)
    return path


def matmul_params(spec: dict[str, int], lm_head: bool = True) -> int:
    """Weights that take part in a token's matmuls (decoder projections [+ LM head]; not the embedding)."""
    h, i, v, L = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"], spec["num_hidden_layers"]
    head_dim = spec.get("head_dim", h // spec["num_attention_heads"])
    q, kv = spec["num_attention_heads"] * head_dim, spec["num_key_value_heads"] * head_dim
    per_layer = h * q * 2 + h * kv * 2 + 3 * h * i
    return L * per_layer + (h * v if lm_head else 0)


def workload_flops(spec: dict[str, int], prompt_lens: Sequence[int], output_lens: Sequence[int]) -> float:
    """Useful FLOPs of a workload: 2 * decoder matmul params per token (every prompt token, no
    prefix-cache discount: a cache hit shows as a higher roofline share), 2 * LM-head params per
    generated token only (what is sampled), plus attention (QK^T and PV: 4 * hidden per layer per
    attended position). The last generated token needs no forward; ignored."""
    h, L = spec["hidden_size"], spec["num_hidden_layers"]
    body = 2 * matmul_params(spec, lm_head=False)
    head = 2 * h * spec["vocab_size"]
    total = 0.0
    for p, o in zip(prompt_lens, output_lens):
        n = p + o
        total += body * n + head * o + 4 * h * L * n * (n + 1) / 2
    return total


# -- workloads --------------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    seed: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def make_workload(
    kind: str,
    n: int,
    seed: int = 0,
    vocab: int = 32000,
    prompt_len: tuple[int, int] = (16, 512),
    output_len: tuple[int, int] = (16, 256),
    prefix_len: int = 256,
    shared_frac: float = 0.8,
) -> Workload:
    """A seeded workload. Prompt lengths are log-uniform in prompt_len (many short, some long), output
    lengths uniform in output_len. "shared": shared_frac of the requests start with the same prefix_len
    tokens followed by their own (log-uniform, 16..256) suffix; the rest are like "mixed". Token ids
    avoid 0-2 (pad/bos/eos)."""
    rng = random.Random(f"{kind}-{seed}")
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    prompts, outs = [], []
    for _ in range(n):
        if kind == "shared" and rng.random() < shared_frac:
            suffix = _log_uniform(rng, 16, max(16, prompt_len[1] - prefix_len))
            prompts.append(prefix + [rng.randrange(3, vocab) for _ in range(suffix)])
        elif kind in ("mixed", "shared"):
            prompts.append([rng.randrange(3, vocab) for _ in range(_log_uniform(rng, *prompt_len))])
        else:
            raise ValueError(f"unknown workload {kind!r}")
        outs.append(rng.randint(*output_len))
    return Workload(kind, prompts, outs, seed)


# -- measurement ------------------------------------------------------------------------------------
STREAM_BYTES = 2**30  # larger than any cache: a streaming read from DRAM


def stream_read_seconds(repeats: int = 5) -> float:
    """Median seconds of torch.sum over STREAM_BYTES of float32: what a memory-bound kernel compares to.
    The buffer is on transparent huge pages where the OS allows (cpu/prefault.anonymous_buffer): no page
    walks slow the stream down, so the floor it sets is the stricter one (~29 GB/s here against ~26-27 on
    4 KiB pages)."""
    import torch

    from asyncengine.cpu.prefault import anonymous_buffer

    x = torch.frombuffer(anonymous_buffer(STREAM_BYTES, huge_pages=True), dtype=torch.float32).fill_(1.0)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def gemm_peak_flops(dtype: str, threads: int, n: int = 1024, seconds: float = 0.6) -> float:
    """Best sustained FLOP/s of a square torch.mm (n x n x n) with `threads` torch threads."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = getattr(torch, dtype)
        a, b = torch.randn(n, n).to(t), torch.randn(n, n).to(t)
        for _ in range(3):
            torch.mm(a, b)
        best = 0.0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(old)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def worker_rss_bytes(parent: int | None = None) -> int:
    """Resident bytes of the asyncengine worker processes under `parent` (this process by default)."""
    parent = os.getpid() if parent is None else parent
    total, todo = 0, [parent]
    while todo:
        pid = todo.pop()
        children = []
        for task in Path(f"/proc/{pid}/task").glob("*"):  # a child belongs to the thread that started it
            with contextlib.suppress(OSError):
                children += (task / "children").read_text().split()
        for child in map(int, children):
            todo.append(child)
            try:
                if b"asyncengine.worker.main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    rss_pages = int(Path(f"/proc/{child}/statm").read_text().split()[1])
                    total += rss_pages * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                pass
    return total


def wait_kv_prefault(kv_bytes: int, timeout: float = 120.0) -> float:
    """After an engine starts, its workers fault the CPU KV cache's pages in from a low-priority thread
    (asyncengine/cpu/prefault.py), as vLLM's zero-filled cache is before it serves; a timed run started at
    once would share the cores with that thread or take the faults itself. Waits until the workers'
    resident memory covers `kv_bytes` and has stopped growing for 1 s, or stops growing for 3 s (or
    `timeout`); returns the seconds waited. (Covering `kv_bytes` alone is not the end: the weights are
    resident too, and stopping there left a quarter of a 2 GiB cache to fault in during the first timed
    cell, the prefault thread taking CPU from its steps.) A no-op where /proc is absent or
    ASYNCENGINE_CPU_KV_PREFAULT=0."""
    if os.environ.get("ASYNCENGINE_CPU_KV_PREFAULT", "1") == "0" or not Path("/proc/self/statm").exists():
        return 0.0
    t0 = last_change = time.monotonic()
    last = worker_rss_bytes()
    while time.monotonic() - t0 < timeout:
        time.sleep(0.5)
        now = worker_rss_bytes()
        if now > last + (1 << 20):
            last, last_change = now, time.monotonic()
        elif time.monotonic() - last_change > (1.0 if now >= kv_bytes else 3.0):
            break
    return time.monotonic() - t0


def wait_quiet(busy_below: float = 0.1, window: float = 0.25, timeout: float = 10.0) -> float:
    """Waits until the machine's cores are busy less than `busy_below` of a `window` (/proc/stat), or
    `timeout`; returns the seconds waited. Between two engines' timed runs: vLLM's engine process polls
    at full speed for ~1 s after a run ends (measured: 96-108% of a core in each of the first 4 quarter
    seconds, ~0 after), and a run started then shares the cores with it (a 1-second cell took twice as
    long). A no-op where /proc/stat is absent."""
    stat = Path("/proc/stat")
    if not stat.exists():
        return 0.0

    def ticks() -> tuple[int, int]:  # (busy, total) jiffies of all cores
        f = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:]]
        idle = f[3] + (f[4] if len(f) > 4 else 0)  # idle + iowait
        return sum(f) - idle, sum(f)

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        b0, n0 = ticks()
        time.sleep(window)
        b1, n1 = ticks()
        if n1 > n0 and (b1 - b0) / (n1 - n0) < busy_below:
            break
    return time.monotonic() - t0


def machine_info() -> dict[str, Any]:
    """Date, load average and versions: every result file records the conditions it was measured in."""
    info: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    return info


def load_line(info: dict[str, Any] | None = None) -> str:
    la = (info or {}).get("loadavg") or [round(x, 2) for x in os.getloadavg()]
    busy = " (NOISY: other work on the machine)" if la[0] >= 1.5 else ""
    return f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} on {os.cpu_count()} cores{busy}"


# -- output -----------------------------------------------------------------------------------------
def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> str:
    """A Markdown table (prints well in a terminal and pastes into RESULTS.md)."""
    cells = [[fmt(c, digits) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    body = [
        "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"
        for r in cells
    ]
    return "\n".join([line, sep, *body])


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def bar_plot(
    path: Path,
    title: str,
    groups: Sequence[str],
    series: dict[str, Sequence[float | None]],
    ylabel: str,
    log: bool = False,
) -> Path | None:
    """Grouped bars: one group per label in `groups`, one bar per series. Returns None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install matplotlib): no plot", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(series)) * 0.5 + 3), 4.5))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ys = [float("nan") if v is None else v for v in values]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- processes --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_available() -> bool:
    return VLLM_PYTHON.exists()


def vllm_env(threads: int, bind: bool, kv_gib: float = 2.0) -> dict[str, str]:
    """vLLM CPU settings. By default vLLM-CPU reserves a core for its frontend and leaves one OMP
    thread on 2 cores; bind=True gives it both (VLLM_CPU_OMP_THREADS_BIND=0-N, no reserved CPU)."""
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_gib)))  # whole GiB only
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    # the engine's own venv must not leak into vLLM's
    env.pop("PYTHONPATH", None)
    return env


def kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group we started (start_new_session=True), then SIGKILL after grace_s."""
    if proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a group whose leader already exited
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def started(
    cmd: Sequence[str], env: dict[str, str] | None = None, log: Path | None = None, cwd: Path | None = None
) -> Iterator[subprocess.Popen]:
    """Starts cmd in its own process group (stdout+stderr to `log` or a pipe) and kills the whole group
    on exit, whatever happens inside the block."""
    out: Any = subprocess.PIPE
    fh = None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(log, "wb")  # noqa: SIM115 (closed below)
        out = fh
    proc = subprocess.Popen(
        list(cmd),
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=cwd,
    )
    try:
        yield proc
    finally:
        kill_group(proc)
        if fh is not None:
            fh.close()


def wait_for_line(
    proc: subprocess.Popen, needle: str, timeout_s: float, log: Path | None = None
) -> tuple[str, float]:
    """Waits until `needle` appears in the process output (a pipe, or the log file it writes);
    returns (line, monotonic time seen). Raises TimeoutError / RuntimeError (process exited)."""
    deadline = time.monotonic() + timeout_s
    if log is None:
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        buf = b""
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buf += chunk
                for line in buf.decode(errors="replace").splitlines():
                    if needle in line:
                        return line, time.monotonic()
            elif proc.poll() is not None:
                break
        raise (TimeoutError if proc.poll() is None else RuntimeError)(
            f"{needle!r} not seen (exit code {proc.poll()}); output tail:\n"
            f"{buf.decode(errors='replace')[-2000:]}"
        )
    pos = 0
    text = ""
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            with open(log, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            pos += len(chunk)
            text += chunk.decode(errors="replace")
            for line in text.splitlines():
                if needle in line:
                    return line, time.monotonic()
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise (TimeoutError if proc.poll() is None else RuntimeError)(
        f"{needle!r} not seen in {log} (exit code {proc.poll()}); tail:\n{text[-2000:]}"
    )


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> float:
    """Polls url until HTTP 200; returns the monotonic time it answered."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic()
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready within {timeout_s:.0f}s")


# -- streaming clients (asyncengine serve and vllm serve speak the same OpenAI HTTP) -----------------
@dataclass
class StreamResult:
    """One streamed request, timed on the client: perf_counter seconds."""

    sent: float
    first: float | None = None  # first chunk carrying generated text / tokens
    events: list[float] | None = None  # arrival time of every chunk carrying output
    tokens: int = 0  # generated tokens (usage, or token ids counted)
    error: str | None = None
    end: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first is not None


async def http_stream(
    client: Any, base_url: str, model: str, prompt_ids: list[int], max_tokens: int, timeout_s: float
) -> StreamResult:
    """POST /v1/completions with stream=true (greedy, EOS ignored) and time the SSE chunks."""
    import asyncio

    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }  # vLLM's too: token ids in every chunk, for models without a tokenizer
    res = StreamResult(sent=time.perf_counter(), events=[])

    async def go() -> None:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])[:200]
                    return
                now = time.perf_counter()
                choices = msg.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("token_ids")):
                    if res.first is None:
                        res.first = now
                    assert res.events is not None
                    res.events.append(now)
                if msg.get("usage"):
                    res.tokens = int(msg["usage"].get("completion_tokens") or 0)

    try:
        await asyncio.wait_for(go(), timeout_s)
    except Exception as e:  # timeouts, refused connections, protocol errors: a failure, not a crash
        res.error = f"{type(e).__name__}: {e}"[:200]
    res.end = time.perf_counter()
    if res.error is None and res.tokens == 0:
        res.tokens = len(res.events or [])
    return res


def apply_quick(args: Any, parser: Any, overrides: dict[str, Any]) -> None:
    """--quick: smaller settings, except where a flag was given explicitly (it wins)."""
    for name, value in overrides.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)
