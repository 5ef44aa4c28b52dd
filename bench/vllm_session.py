"""A loaded vLLM-CPU that runs workloads one at a time on request: bench/vllm_runner.py --serve.

bench/sweep.py keeps one of these beside its asyncengine `LLM` and alternates the two engines cell by
cell, so that both measure a cell under the same machine conditions: on a shared VM the speed of a run
drifts 10-30% over the half hour one engine's whole row takes, which a row run by one engine and then
the other turns into a ratio error.

    with VllmSession(spec, env, log) as vllm:
        r = vllm.run("p16-256/o8-64", prompts, output_lens, timeout=600)  # {"seconds", "token_ids"}

Runs go to the runner's stdin as JSON lines; its answers come back on a pipe of their own (vLLM logs
to stdout). Every wait has a timeout; the runner's process group is killed on exit, on a timeout and on
any error.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from common import VLLM_PYTHON, kill_group

RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"


class VllmSessionError(RuntimeError):
    """The runner died, timed out or answered out of turn; the message ends with its log's tail."""


class VllmSession:
    def __init__(
        self,
        spec: dict[str, Any],
        env: dict[str, str],
        log: Path,
        load_timeout: float = 900.0,
        python: Path = VLLM_PYTHON,
        runner: Path = RUNNER,
    ) -> None:
        """spec: vllm_runner.py's in.json without prompts or runs (model, dtype, limits); env: vllm_env()."""
        self.spec, self.env, self.log = spec, env, log
        self.load_timeout = load_timeout
        self.python, self.runner = python, runner
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self._buf = b""

    def __enter__(self) -> VllmSession:
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-vllm-session-")
        workload = Path(self._tmp.name) / "in.json"
        workload.write_text(json.dumps(self.spec))
        read_fd, write_fd = os.pipe()
        self._results = read_fd
        self._log_fh = open(self.log, "wb")  # noqa: SIM115  (closed in close())
        try:
            self.proc = subprocess.Popen(
                [str(self.python), str(self.runner), "--workload", str(workload), "--serve"]
                + ["--result-fd", str(write_fd)],
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=self._log_fh,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                start_new_session=True,
                cwd=self._tmp.name,
            )
        except BaseException:
            os.close(read_fd)
            self._log_fh.close()
            self._tmp.cleanup()
            raise
        finally:
            os.close(write_fd)  # the child's copy stays open: EOF here means the runner is gone
        try:
            answer = self._read_line(self.load_timeout)
            if not answer.get("ready"):
                raise self._error(f"expected the ready line, got {answer!r}")
            self.info = {k: v for k, v in answer.items() if k != "ready"}
        except BaseException:
            self.close(clean=False)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def run(
        self, name: str, prompts: list[list[int]], output_lens: list[int], timeout: float
    ) -> dict[str, Any]:
        """One workload (cold prefix cache) -> {"seconds", "token_ids"}; VllmSessionError on any failure."""
        assert self.proc is not None and self.proc.stdin is not None, "run() outside the with block"
        line = json.dumps({"name": name, "prompts": prompts, "output_lens": output_lens}) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
            answer = self._read_line(timeout)
        except BaseException as e:
            self.close(clean=False)
            if isinstance(e, VllmSessionError):
                raise
            if isinstance(e, OSError):  # a broken pipe: the runner is gone
                raise self._error(f"the runner is gone ({e})") from e
            raise
        if answer.get("name") != name:
            raise self._error(f"asked for {name!r}, got an answer for {answer.get('name')!r}")
        return {"seconds": answer["seconds"], "token_ids": answer["token_ids"]}

    def _read_line(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(f"no answer within {timeout:.0f} s")
            ready, _, _ = select.select([self._results], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._results, 1 << 20)
                if not chunk:
                    raise self._error("the runner exited")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError as e:
            raise self._error(f"an answer that is not JSON: {line[:200]!r}") from e

    def _error(self, what: str) -> VllmSessionError:
        self.close(clean=False)
        tail = self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""
        return VllmSessionError(f"vLLM session: {what} (log {self.log}):\n{tail}")

    def close(self, clean: bool = True) -> None:
        """Ends the runner (stdin closed; with `clean`, up to 10 s to exit; then its process group killed)
        and frees the pipes; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
            try:
                proc.wait(10 if clean else 0)  # a clean exit after stdin's EOF
            except subprocess.TimeoutExpired:
                pass
            kill_group(proc, 10 if clean else 2)
            os.close(self._results)
            self._log_fh.close()
            self._tmp.cleanup()
