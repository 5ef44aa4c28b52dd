"""bench/sweep.py's passes over the grid (--repeats): both engines run every cell once a pass, in an order
that flips cell by cell and pass by pass, and each engine's fastest run of a cell is the one reported."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import sweep  # noqa: E402
from common import Workload  # noqa: E402


def test_with_run_keeps_every_run_and_reports_the_fastest() -> None:
    first = sweep.with_run(None, {"seconds": 2.0, "token_ids": [(1, 2)]})
    assert first == {"seconds": 2.0, "runs": [2.0], "token_ids": [[1, 2]]}
    second = sweep.with_run(first, {"seconds": 1.5, "token_ids": [(1, 2)]})
    third = sweep.with_run(second, {"seconds": 3.0, "token_ids": [(1, 2)]})
    assert third["runs"] == [2.0, 1.5, 3.0] and third["seconds"] == 1.5


def test_passes_alternate_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []

    def fake(engine: str) -> Any:
        @contextlib.contextmanager
        def session(model: Path, dtype: str, args: argparse.Namespace) -> Iterator[sweep.Runner]:
            def run(name: str, wl: Workload) -> dict[str, Any]:
                calls.append((engine, name))
                return {"seconds": float(len(calls)), "token_ids": [[7]]}

            yield run

        return session

    monkeypatch.setattr(sweep, "ENGINES", {"asyncengine": fake("asyncengine"), "vllm": fake("vllm")})
    monkeypatch.setattr(sweep, "wait_quiet", lambda: 0.0)
    todo = [(f"p1-2/o{i}", Workload("mixed", [[5]], [1], 0)) for i in range(3)]
    saved: dict[tuple[str, str], dict[str, Any]] = {}

    def save(engine: str, cell: str, r: dict[str, Any]) -> None:
        saved[engine, cell] = sweep.with_run(saved.get((engine, cell)), r)

    args = argparse.Namespace(sequential=False, repeats=2)
    sweep.run_dtype(Path("m"), "bfloat16", ["asyncengine", "vllm"], todo, args, save)
    timed = [c for c in calls if c[1] != "warm-up"]
    ae, vl = ("asyncengine", "vllm"), ("vllm", "asyncengine")
    orders = [tuple(e for e, _ in timed[i : i + 2]) for i in range(0, len(timed), 2)]
    assert orders == [ae, vl, ae, vl, ae, vl]  # pass 2 starts with the other engine on cell 0
    assert all(len(r["runs"]) == 2 and r["seconds"] == min(r["runs"]) for r in saved.values())
    assert len(saved) == 6


def test_the_bundled_model_keeps_only_cells_that_fit_its_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """--model default: the sweep takes the bundled model's context and vocabulary; the cells kept have every
    request within its positions and every token within its vocabulary."""
    monkeypatch.setattr(sweep, "MAX_MODEL_LEN", sweep.MAX_MODEL_LEN)  # restored after the test
    monkeypatch.setattr(sweep, "VOCAB", sweep.VOCAB)
    sweep.bundled_model()
    assert (sweep.MAX_MODEL_LEN, sweep.VOCAB) == (1024, 4096)
    todo = sweep.cells(64, 0, False)
    kept = [name for name, wl in todo if sweep.fits(wl)]
    assert {n for n in kept if n.startswith("p16-256/")} == {n for n, _ in todo if n.startswith("p16-256/")}
    assert not any(n.startswith("p512-2048/") for n in kept)
    for name, wl in todo:
        assert all(max(p) < 4096 for p in wl.prompts)
        if name in kept:
            assert all(len(p) + n <= 1024 for p, n in zip(wl.prompts, wl.output_lens))
    assert sweep.fits(sweep.warm_up())
