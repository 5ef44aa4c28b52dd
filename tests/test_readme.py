"""README.md's examples run as written: every ```python block, as a file, against the Quickstart server.

The Quickstart server is `asyncengine serve` with no flags: the bundled default model, served as
"default-model", no API key, on port 8000. The test's server is that, except that it listens on a free
port (and uses float32 and a small KV cache, which change no output of the bundled float32 model): each
block's `http://127.0.0.1:8000` and `ws://127.0.0.1:8000` are rewritten to that port before it runs.
"""

from __future__ import annotations

import codecs
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from asyncengine.config import default_model_path

sys.path.append(str(Path(__file__).resolve().parent / "asyncengine" / "entrypoints"))
from server_process import ServerProcess, start_server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

README = Path(__file__).resolve().parents[1] / "README.md"
QUICKSTART = "127.0.0.1:8000"  # where the README's examples expect the server
SNIPPET_TIMEOUT_S = 240
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(README.read_text()) if kind == lang]


PYTHON_BLOCKS = blocks("python")


def no_key_env() -> dict[str, str]:
    """This process's environment without ASYNCENGINE_API_KEY: the Quickstart server has no key."""
    return {k: v for k, v in os.environ.items() if k != "ASYNCENGINE_API_KEY"}


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("readme")
    srv = start_server(Path(default_model_path()), tmp, env={"ASYNCENGINE_API_KEY": ""})  # "": no key
    yield srv
    srv.kill()


def test_the_readme_has_its_examples() -> None:
    assert len(PYTHON_BLOCKS) >= 3  # the engine, the OpenAI SDK, the websocket client


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_block_runs_as_a_file(index: int, quickstart: ServerProcess, tmp_path: Path) -> None:
    code = PYTHON_BLOCKS[index]
    # the test's server listens on a free port, not on the README's 8000: point the snippet at it
    code = code.replace(f"http://{QUICKSTART}", quickstart.base)
    code = code.replace(f"ws://{QUICKSTART}", f"ws://{quickstart.host}:{quickstart.port}")
    assert QUICKSTART not in code and ":8000" not in code, "an address the test does not rewrite"
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(code)
    # cwd=tmp_path: the repository root would shadow the installed package (see server_process.start_server)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=no_key_env(),
        timeout=SNIPPET_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"README block {index} failed:\n{code}\n--- stderr:\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"README block {index} printed nothing:\n{code}"


def test_generate_example_shows_its_actual_output(quickstart: ServerProcess) -> None:
    """The `asyncengine generate` example's output, shown in the README, is the model's greedy output."""
    text = README.read_text()
    command = re.search(r"asyncengine generate --max-tokens (\d+) --temperature 0 \$'([^']*)'\n```\n", text)
    assert command is not None
    shown = FENCE.match(text, text.index("```text\n", command.end()))
    assert shown is not None and shown.group(1) == "text"
    prompt = codecs.decode(command.group(2), "unicode_escape")  # bash's $'...' escapes
    r = httpx.post(
        f"{quickstart.base}/v1/completions",
        timeout=120,
        json={
            "model": "default-model",
            "prompt": prompt,
            "max_tokens": int(command.group(1)),
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    # `generate` ends its output with a newline, as the block does
    assert r.json()["choices"][0]["text"] + "\n" == shown.group(2)
