"""The `asyncengine` command: start-up errors, `generate`, and how `serve` shuts down (SIGTERM, SIGKILL)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import API_KEY, ServerProcess, alive, children, free_port, start_server
from websockets.sync.client import connect

pytestmark = pytest.mark.timeout(120)


def cli(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "asyncengine", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


@dataclass
class Background:
    generate: subprocess.Popen
    term: ServerProcess  # for SIGTERM, on a known port (its /health is polled while it loads)
    term_port: int
    kill: ServerProcess  # for SIGKILL


@pytest.fixture(scope="module")
def background(
    chat_model: Path, tiny_model_factory: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Background]:
    """The slow processes, started at once so their start-ups overlap: a `generate` run and two servers.
    The SIGTERM one serves the tiny model with 16,384 positions: its requests can outlast any grace."""
    tmp = tmp_path_factory.mktemp("cli")
    port = free_port()
    long_model = tiny_model_factory("llama", tokenizer=True, max_position_embeddings=16384)
    # 1,024 blocks of 64 tokens: the four 15,000-token requests below fit at once (512 bytes a token)
    term = start_server(
        long_model, tmp, "--shutdown-timeout", "0.2", "--num-kv-blocks", "1024", port=port, wait=False
    )
    kill = start_server(chat_model, tmp, wait=False)
    gen = cli(
        tmp,
        "generate",
        "--model",
        str(chat_model),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
        "hello world",
    )
    yield Background(gen, term, port, kill)
    term.kill()
    kill.kill()
    gen.kill()
    gen.communicate()


def wait_exit(server: ServerProcess, timeout_s: float) -> int:
    try:
        return server.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        raise AssertionError(
            f"server still running after {timeout_s}s:\n{server.log.read_text()[-3000:]}"
        ) from None


@pytest.mark.slow
def test_health_while_loading_then_sigterm_drains_and_exits_clean(background: Background) -> None:
    srv, port = background.term, background.term_port
    seen_loading = False
    deadline = time.monotonic() + 60
    while not seen_loading and time.monotonic() < deadline and srv.proc.poll() is None:
        try:  # the server listens before the model is loaded, and says so
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            seen_loading = r.status_code == 503 and r.json() == {"status": "loading"}
        except httpx.TransportError:
            time.sleep(0.05)
    srv.wait_ready()
    assert seen_loading and srv.port == port
    assert httpx.get(f"{srv.base}/health").status_code == 200
    workers = children(srv.proc.pid)
    assert workers
    with connect(srv.ws_url, open_timeout=20) as ws:
        # four requests of 15,000 tokens (the KV cache holds them all) take seconds on any
        # machine, far past the 0.2 s grace: the shutdown must abort every one. 1,000-token requests were
        # outrun: a CI run finished all four with 'length' (the tiny model's decode steps replay as kernel
        # graphs in a fraction of a millisecond), as a 1 s grace and one such request had been before.
        for i in range(4):
            ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "request_id": f"long-{i}",
                        "prompt": "x",
                        "params": {"max_tokens": 15000, "ignore_eos": True},
                    }
                )
            )
        assert json.loads(ws.recv(30))["type"] == "delta"
        srv.proc.send_signal(signal.SIGTERM)
        finished: dict[str, str] = {}
        while len(finished) < 4:
            frame = json.loads(ws.recv(30))
            if frame["type"] == "done":
                finished[frame["request_id"]] = frame["finish_reason"]
        assert finished == {f"long-{i}": "abort" for i in range(4)}
    assert wait_exit(srv, 30) == 0
    assert not [pid for pid in workers if alive(pid)]


@pytest.mark.slow
def test_sigkill_leaves_no_worker(background: Background) -> None:
    srv = background.kill
    srv.wait_ready()
    workers = children(srv.proc.pid)
    assert workers
    os.kill(srv.proc.pid, signal.SIGKILL)  # only the server: its workers must notice on their own
    srv.proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in workers):
        time.sleep(0.1)
    assert not [pid for pid in workers if alive(pid)]


@pytest.mark.slow
def test_generate_streams_the_greedy_completion(background: Background, server: ServerProcess) -> None:
    want = httpx.post(
        f"{server.base}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"prompt": "hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        timeout=30,
    ).json()["choices"][0]["text"]
    out, err = background.generate.communicate(timeout=90)
    assert background.generate.returncode == 0, err
    assert out == want + "\n"


@pytest.mark.slow
def test_startup_errors(tmp_path: Path, chat_model: Path) -> None:
    """A bad model path, a taken port, more devices than exist: one line on stderr, non-zero exit."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = {  # run at once: each pays the interpreter's import time
            "model directory not found": ["--model", str(tmp_path / "missing"), "--port", "0"],
            f"cannot listen on 127.0.0.1:{port}": [
                "--model",
                str(chat_model),
                "--port",
                str(port),
                "--device",
                "cpu",
            ],
            "visible": [
                "--model",
                str(chat_model),
                "--port",
                "0",
                *(["-tp", str(gpus + 1)] if gpus else ["--device", "cuda"]),
            ],
        }
        procs = {want: cli(tmp_path, "serve", *args) for want, args in cases.items()}
        results = {want: (p.communicate(timeout=90), p.returncode) for want, p in procs.items()}
    for want, ((out, err), code) in results.items():
        lines = [line for line in err.splitlines() if line.startswith("asyncengine: error:")]
        assert code == 1 and len(lines) == 1 and want in lines[0] and out == "", (want, err)


# -- the first minutes: --help, --version, a wrong --model ----------------------------------------
def test_every_flag_says_what_it_does_and_its_default() -> None:
    from asyncengine.entrypoints.cli import HelpFormatter, VersionAction, build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    formatter = HelpFormatter("asyncengine")
    for name in ("serve", "generate"):
        for action in subs[name]._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, VersionAction)):
                continue
            text = formatter._get_help_string(action)
            assert action.help and len(action.help.split()) >= 3, (name, action.option_strings)
            assert "default" in text, (name, action.option_strings, text)
    serve_help = subs["serve"].format_help()
    assert "bundled default model" in serve_help and "(default: 8000)" in serve_help
    model = next(a for a in subs["serve"]._actions if "--model" in a.option_strings)
    assert "bundled default model" in formatter._get_help_string(model)


def test_help_and_version_are_fast_and_torch_free(tmp_path: Path) -> None:
    import importlib.metadata

    procs = {
        args: subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "asyncengine", *args],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in (("--help",), ("serve", "--help"), ("generate", "--help"), ("--version",))
    }
    for args, p in procs.items():
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, (args, err[-2000:])
        imported = {m.group(1).split(".")[0] for m in re.finditer(r"^import time:.*\|\s+(\S+)$", err, re.M)}
        assert imported and not imported & {"torch", "transformers", "triton"}, args
        if args == ("--version",):
            assert out == f"asyncengine {importlib.metadata.version('asyncengine')}\n"
        else:
            assert out.startswith("usage: asyncengine")


def test_model_not_found_names_the_hub_download() -> None:
    from asyncengine.config import model_not_found

    message = model_not_found("Qwen/Qwen2-0.5B")
    assert message.startswith("model directory not found: Qwen/Qwen2-0.5B. Only local model directories")
    assert "`huggingface-cli download Qwen/Qwen2-0.5B --local-dir ./Qwen2-0.5B`" in message
    assert "`hf download Qwen/Qwen2-0.5B --local-dir ./Qwen2-0.5B`" in message
    for path in ("/no/such/model", "./models/missing", "missing"):  # paths, not Hub ids: no download advice
        assert model_not_found(path) == f"model directory not found: {path}"


def test_hub_id_or_folder_without_config_json_fail_before_the_server_starts(tmp_path: Path) -> None:
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "model.safetensors").write_bytes(b"")
    cases = {
        "huggingface-cli download Qwen/Qwen2-0.5B --local-dir ./Qwen2-0.5B": ["--model", "Qwen/Qwen2-0.5B"],
        "not-a-model has no config.json": ["--model", str(tmp_path / "not-a-model")],
    }
    procs = {want: cli(tmp_path, "serve", "--port", "0", *args) for want, args in cases.items()}
    for want, p in procs.items():
        out, err = p.communicate(timeout=60)
        # one line, and nothing of a server: no "Started server process", no URL line
        assert p.returncode == 1 and out == "" and len(err.splitlines()) == 1, (want, out, err)
        assert err.startswith("asyncengine: error: ") and want in err, err
