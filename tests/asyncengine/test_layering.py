"""The floor rule: asyncengine.cpu and asyncengine.cuda (the device backends) import nothing above them.

The layers pick a backend and import from these packages, never the other way round. Checked two ways:
a fresh interpreter imports every module of the floor and must not have loaded a module from above, and
no import statement in their source (function-level ones included, which an import alone never runs)
names one.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import asyncengine.cpu
import asyncengine.cuda

FLOORS = {"asyncengine.cpu": asyncengine.cpu, "asyncengine.cuda": asyncengine.cuda}
ABOVE = (
    "asyncengine.layers",
    "asyncengine.models",
    "asyncengine.worker",
    "asyncengine.engine",
    "asyncengine.entrypoints",
)


def _modules(package: str) -> list[str]:
    path = FLOORS[package].__path__
    return [package, *(f"{package}.{m.name}" for m in pkgutil.iter_modules(path))]


def _is_above(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in ABOVE)


def test_floor_modules_are_found() -> None:
    """Guards the checks below against passing on an empty module list."""
    cpu = _modules("asyncengine.cpu")
    for name in ("build", "ops", "gemm", "amx", "attention", "kernel_graph"):
        assert f"asyncengine.cpu.{name}" in cpu
    assert "asyncengine.cuda.graph_runner" in _modules("asyncengine.cuda")


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_importing_the_floor_loads_nothing_above(package: str) -> None:
    modules = _modules(package)
    # one fresh interpreter: after each import, what from above has been loaded so far
    script = (
        "import importlib, json, sys\n"
        f"above = {ABOVE!r}\n"
        "report = {}\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    report[name] = sorted("
        "m for m in sys.modules if any(m == a or m.startswith(a + '.') for a in above))\n"
        "print(json.dumps(report))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(report) == modules
    first = next(((name, loaded) for name, loaded in report.items() if loaded), None)
    assert first is None, f"importing {first[0]} loaded {first[1]}"


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_no_import_statement_reaches_above(package: str) -> None:
    root = Path(FLOORS[package].__path__[0])
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            bad += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if _is_above(n)]
    assert not bad, f"{package} imports from above it: {bad}"
