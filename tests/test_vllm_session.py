"""bench/vllm_session.py's protocol with bench/vllm_runner.py --serve, against a stand-in runner (vLLM
itself lives in bench/vllm_venv, which CI does not build): answers in turn, and never a hang when the
runner dies, stalls or answers out of turn."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from vllm_session import VllmSession, VllmSessionError  # noqa: E402

# The runner's side of the protocol; "behaviour" in the workload spec makes it misbehave on cue.
FAKE_RUNNER = textwrap.dedent(
    """
    import argparse, json, os, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--workload")
    p.add_argument("--serve", action="store_true")
    p.add_argument("--result-fd", type=int)
    a = p.parse_args()
    spec = json.load(open(a.workload))
    out = open(a.result_fd, "w", buffering=1)
    if spec.get("behaviour") == "never_ready":
        time.sleep(60)
    print("some vLLM log line on stdout", flush=True)
    out.write(json.dumps({"ready": True, "vllm_version": "fake", "pid": os.getpid()}) + "\\n")
    for line in sys.stdin:
        r = json.loads(line)
        if spec.get("behaviour") == "die" and r["name"] == "second":
            os._exit(3)
        if spec.get("behaviour") == "stall" and r["name"] == "second":
            time.sleep(60)
        if spec.get("behaviour") == "garbled" and r["name"] == "second":
            out.write("not json\\n")
            continue
        name = "someone else" if spec.get("behaviour") == "wrong_name" else r["name"]
        ids = [[len(p)] * n for p, n in zip(r["prompts"], r["output_lens"])]
        out.write(json.dumps({"name": name, "seconds": 0.5, "token_ids": ids}) + "\\n")
    """
)


def session(tmp_path: Path, behaviour: str = "", load_timeout: float = 30.0) -> VllmSession:
    runner = tmp_path / "fake_runner.py"
    runner.write_text(FAKE_RUNNER)
    spec = {"model": "m", "dtype": "bfloat16", "behaviour": behaviour}
    return VllmSession(
        spec, dict(os.environ), tmp_path / "log", load_timeout, python=Path(sys.executable), runner=runner
    )


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(60)
def test_runs_are_answered_in_turn_and_the_runner_ends_with_the_session(tmp_path: Path) -> None:
    with session(tmp_path) as s:
        assert s.info["vllm_version"] == "fake"
        pid = s.info["pid"]
        assert s.run("first", [[1, 2, 3], [4]], [2, 1], timeout=10) == {
            "seconds": 0.5,
            "token_ids": [[3, 3], [1]],
        }
        assert s.run("second", [[5] * 7], [3], timeout=10)["token_ids"] == [[7, 7, 7]]
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)
    assert "some vLLM log line" in (tmp_path / "log").read_text()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("behaviour", ["die", "stall", "wrong_name", "garbled"])
def test_a_runner_that_fails_a_run_raises_instead_of_hanging(tmp_path: Path, behaviour: str) -> None:
    with session(tmp_path, behaviour) as s:
        pid = s.info["pid"]
        if behaviour != "wrong_name":
            s.run("first", [[1]], [1], timeout=10)
        t0 = time.monotonic()
        with pytest.raises(VllmSessionError, match="vLLM session"):
            s.run("second", [[1]], [1], timeout=2)
        assert time.monotonic() - t0 < 15
        assert s.proc is None  # closed on the error
    assert gone(pid)


@pytest.mark.timeout(60)
def test_a_runner_that_never_loads_times_out(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(VllmSessionError, match="no answer within"):
        with session(tmp_path, "never_ready", load_timeout=2):
            pass
    assert time.monotonic() - t0 < 20


def test_close_is_idempotent_and_kills_the_group(tmp_path: Path) -> None:
    s = session(tmp_path).__enter__()
    pid = s.info["pid"]
    s.close()
    s.close()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the runner led its own group: nothing of it is left
