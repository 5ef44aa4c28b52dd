"""Replaying a kernel graph's runs of C kernel calls from C: csrc/call_list.c runs a list of recorded calls
in one ctypes call (on x86-64 and AArch64 Linux, whose calling conventions let one prototype call every
kernel): ~1.7 us of ctypes a call less, on ~110 calls a decode step (cpu/kernel_graph.py records them).
ASYNCENGINE_KERNEL_GRAPH_CALL_LIST=0 replays each call from Python."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from asyncengine.cpu.build import build_library

logger = logging.getLogger(__name__)

CALL_LIST_SOURCE = Path(__file__).parent / "csrc" / "call_list.c"
MAX_INTS, MAX_FLOATS = 24, 4  # call_list.c's one prototype
_INT_TYPES = {ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int32}
_RESULT_CHECK = {None: 0, ctypes.c_int: 4, ctypes.c_int32: 4, ctypes.c_long: 8, ctypes.c_int64: 8}


class Call(ctypes.Structure):  # call_list.c's Call
    _fields_ = [
        ("fn", ctypes.c_void_p),
        ("ints", ctypes.c_int64 * MAX_INTS),
        ("floats", ctypes.c_float * MAX_FLOATS),
        ("check", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("expect", ctypes.c_int64),
        ("got", ctypes.c_int64),
    ]


@cache
def load_call_list_library() -> ctypes.CDLL | None:
    """call_list.c where its one-prototype calls are valid (x86-64 / AArch64 Linux) and it builds."""
    if os.environ.get("ASYNCENGINE_KERNEL_GRAPH_CALL_LIST", "1") == "0":
        return None
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return None
    lib = build_library(CALL_LIST_SOURCE)
    if lib is None:
        return None
    signatures = {
        "call_list_layout": (ctypes.c_int, []),
        "run_call_list": (ctypes.c_long, [ctypes.c_void_p, ctypes.c_long]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.call_list_layout() != ctypes.sizeof(Call):
        logger.warning("call_list.c's layout differs from call_list.Call: replaying through ctypes")
        return None
    return lib


class KernelCall:
    """One recorded kernel call, replayed through ctypes (or gathered into a call list)."""

    def __init__(self, fn: Any, args: tuple[Any, ...], result: Any) -> None:
        self.fn, self.args, self.result = fn, args, result
        self.name = getattr(fn, "__name__", "kernel")

    def __call__(self) -> None:
        rc = self.fn(*self.args)
        if rc != self.result:
            raise RuntimeError(
                f"{self.name} returned {rc} on replay where the captured call returned {self.result}"
            )

    def as_call(self) -> Call | None:
        """The call as call_list.c runs it; None where its signature is not one the list can call."""
        argtypes, restype = getattr(self.fn, "argtypes", None), getattr(self.fn, "restype", 0)
        if argtypes is None or restype not in _RESULT_CHECK or len(argtypes) != len(self.args):
            return None
        ints: list[int] = []
        floats: list[float] = []
        for kind, value in zip(argtypes, self.args, strict=True):
            if isinstance(value, ctypes._SimpleCData):
                value = value.value
            if kind in _INT_TYPES and (value is None or isinstance(value, int)):
                ints.append(value or 0)
            elif kind is ctypes.c_float and isinstance(value, (int, float)):
                floats.append(float(value))
            else:
                return None
        if len(ints) > MAX_INTS or len(floats) > MAX_FLOATS:
            return None
        call = Call()
        call.fn = ctypes.cast(self.fn, ctypes.c_void_p).value
        call.ints[: len(ints)] = ints
        call.floats[: len(floats)] = floats
        call.check = _RESULT_CHECK[restype]
        call.expect = int(self.result) if call.check else 0
        return call


def call_list(calls: list[KernelCall], lib: ctypes.CDLL) -> Callable[[], None]:
    """One replay step running `calls` in C, in order."""
    array = (Call * len(calls))(*(c.as_call() for c in calls))
    run, n = lib.run_call_list, len(calls)

    def step() -> None:
        bad = run(array, n)
        if bad:
            call = calls[bad - 1]
            raise RuntimeError(
                f"{call.name} returned {array[bad - 1].got} on replay where the captured call returned "
                f"{call.result}"
            )

    return step
