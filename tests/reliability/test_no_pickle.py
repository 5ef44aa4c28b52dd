"""No pickle, cloudpickle, recv_pyobj or eval on any path that reads bytes from another process."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "asyncengine", ROOT / "transport", ROOT / "cuda"]
FORBIDDEN_MODULES = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "_pickle"}
FORBIDDEN_METHODS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}
FORBIDDEN_BUILTINS = {"eval", "exec", "__import__"}


def python_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in pkg.rglob("*.py")]


def test_scan_covers_the_packages() -> None:
    files = python_files()
    assert len(files) > 30
    assert any(p.name == "channels.py" for p in files)


def test_no_pickle_imports_or_dangerous_calls() -> None:
    offences = []
    for path in python_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                names = []
            offences += [f"{path}:{node.lineno} imports {n}" for n in names if n in FORBIDDEN_MODULES]
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                # model.eval() is a method; the builtin eval is a bare name
                if (isinstance(func, ast.Attribute) and name in FORBIDDEN_METHODS) or (
                    isinstance(func, ast.Name) and name in FORBIDDEN_BUILTINS
                ):
                    offences.append(f"{path}:{node.lineno} calls {name}")
                if (
                    name == "load"
                    and isinstance(func, ast.Attribute)
                    and getattr(func.value, "id", "") == "torch"
                ):
                    weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                    if not weights_only or getattr(weights_only[0].value, "value", None) is not True:
                        offences.append(f"{path}:{node.lineno} torch.load without weights_only=True")
    assert not offences, "\n".join(offences)


def test_multiprocessing_is_not_used_to_start_workers() -> None:
    # multiprocessing's spawn pickles the process object into the child through a pipe
    for path in python_files():
        text = path.read_text()
        assert "multiprocessing" not in text or "worker" not in path.name, path
