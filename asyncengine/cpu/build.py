"""Builds the C sources in cpu/csrc/ into shared libraries on first use, cached per machine.

The kernels are plain C (no torch headers), compiled by the system compiler in well under a second
and loaded with ctypes; tensors are passed as data pointers. The cache key covers the source, the
flags and the CPU's feature flags, so a copied cache directory never loads code built for another CPU.
Without a compiler, or when the build fails, callers get None and use their PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

# -ffp-contract=off: a*b - c*d stays two rounded products, as torch computes it (no implicit FMA)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
PORTABLE_FLAGS = ["-mno-avx512f"]  # the plain-C variants, even where AVX-512 exists (tests cover both)


_LOADED: list[ctypes.CDLL] = []  # every library build_library returned, for kernel-graph capture


def loaded_libraries() -> list[ctypes.CDLL]:
    """The kernel libraries loaded so far (cpu/kernel_graph.py records calls into them)."""
    return list(_LOADED)


def cache_dir() -> Path:
    root = os.environ.get("ASYNCENGINE_CACHE_DIR") or Path.home() / ".cache" / "asyncengine"
    return Path(root)


@cache
def _cpuinfo_field(name: str) -> str:
    """The first /proc/cpuinfo line starting with `name` ("flags", "vendor_id"), or "" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line
    except OSError:
        pass
    return ""


def _cpu_flags() -> str:
    return _cpuinfo_field("flags")


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where there is none."""
    line = _cpuinfo_field("vendor_id")
    return line.split(":", 1)[1].strip() if ":" in line else ""


def cpu_family() -> int:
    """/proc/cpuinfo's "cpu family" (AMD: 25 for Zen 3 and 4, 26 for Zen 5), or 0 where there is none."""
    value = _cpuinfo_field("cpu family").partition(":")[2].strip()
    return int(value) if value.isdigit() else 0


def build_library(source: Path, portable: bool = False) -> ctypes.CDLL | None:
    """Compiles `source` (once per source, flags and CPU) and loads it; None when it cannot be built."""
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found: %s falls back to PyTorch", source.name)
        return None
    flags = [*CFLAGS, *PORTABLE_FLAGS] if portable else CFLAGS
    if cpu_vendor() == "AuthenticAMD":  # for choices measured per CPU (cpu_common.h CPU_ZEN4)
        flags = [*flags, "-DASYNCENGINE_AMD_CPU", f"-DASYNCENGINE_CPU_FAMILY={cpu_family()}"]
    # the headers it may include (csrc/*.h) are part of what gets built, so part of the key too
    code = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(code + " ".join(flags).encode() + _cpu_flags().encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *flags, "-o", tmp, str(source), "-lm"],
                check=True,
                capture_output=True,
                timeout=120,
            )
            os.replace(tmp, target)  # atomic: workers compiling at once never load a half-written file
        except (subprocess.SubprocessError, OSError) as e:
            logger.warning("building %s failed (%s): using PyTorch instead", source.name, e)
            Path(tmp).unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(target))
    _LOADED.append(lib)
    return lib
