"""cpu/build.py: the compiled-library cache is keyed by the C source and the headers beside it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from asyncengine.cpu import amx, attention, build, ops, quant_gemm

needs_compiler = pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler"
)


def test_kernel_sources_ship_beside_build() -> None:
    csrc = Path(build.__file__).parent / "csrc"
    for source in (ops.SOURCE, amx.SOURCE, attention.SOURCE, attention.AMX_SOURCE):
        assert source.is_file() and source.parent == csrc, source


@needs_compiler
def test_cache_key_follows_source_and_headers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCENGINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_LOADED", [])  # keep these out of kernel-graph capture
    src, header = tmp_path / "k.c", tmp_path / "k.h"
    header.write_text("#define ANSWER 42\n")
    src.write_text('#include "k.h"\nint answer(void) { return ANSWER; }\n')

    def built() -> set[str]:
        lib = build.build_library(src)
        assert lib is not None and lib.answer() == int(header.read_text().split()[-1])
        return {p.name for p in (tmp_path / "cache").glob("k-*.so")}

    first = built()
    assert built() == first and len(first) == 1  # same sources: the cached library, nothing rebuilt
    src.write_text(src.read_text() + "/* edited */\n")
    second = built()
    assert len(second) == 2
    header.write_text("#define ANSWER 7\n")  # a header change alone rebuilds too
    assert len(built()) == 3


def test_tile_configs_are_loaded_through_configure_tiles() -> None:
    """GCC's _tile_loadconfig(&cfg) tells the compiler that ldtilecfg reads 8 bytes of the 64-byte config,
    so at -O3 the stores of the tile widths can be dropped and ldtilecfg faults (seen 2026-12-05 in
    amx_linear_quant). amx_common.h's configure_tiles states the whole struct as its operand; no kernel may
    go around it."""
    csrc = Path(build.__file__).parent / "csrc"
    offenders = [p.name for p in sorted(csrc.glob("*.[ch]")) if "_tile_loadconfig(" in p.read_text()]
    assert offenders == []
    assert '"m"(c)' in (csrc / "amx_common.h").read_text()


@needs_compiler
@pytest.mark.parametrize("portable", [False, True])
def test_every_kernel_source_builds(portable: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kernel's module skips its tests where its library is None, and a library is None where the build
    fails: a source that stops compiling would turn its tests into skips, not failures. Every csrc/*.c must
    build here, native and portable, into a fresh cache."""
    monkeypatch.setenv("ASYNCENGINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_LOADED", [])  # keep these out of kernel-graph capture
    csrc = Path(build.__file__).parent / "csrc"
    failed = [p.name for p in sorted(csrc.glob("*.c")) if build.build_library(p, portable) is None]
    assert failed == []


@needs_compiler
@pytest.mark.parametrize(
    ("vendor", "family", "seen"),
    [("AuthenticAMD", "25", 25), ("AuthenticAMD", "26", 26), ("GenuineIntel", "6", -1)],
)
def test_amd_builds_see_the_cpu_family(
    vendor: str, family: str, seen: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Choices measured per CPU (csrc/paged_attention.c's prefetches: Zen 4 and Zen 5 differ) read
    ASYNCENGINE_CPU_FAMILY, defined on AMD CPUs only; the family is in the cache key through the flags."""
    monkeypatch.setenv("ASYNCENGINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_LOADED", [])
    fields = {"vendor_id": f"vendor_id\t: {vendor}", "cpu family": f"cpu family\t: {family}"}
    monkeypatch.setattr(build, "_cpuinfo_field", lambda name: fields.get(name, ""))
    src = tmp_path / "f.c"
    src.write_text(
        "#ifdef ASYNCENGINE_AMD_CPU\nint family(void) { return ASYNCENGINE_CPU_FAMILY; }\n"
        "#else\nint family(void) { return -1; }\n#endif\n"
    )
    lib = build.build_library(src)
    assert lib is not None and lib.family() == seen
    assert build.cpu_family() == int(family)


@needs_compiler
@pytest.mark.parametrize("family", [25, 26])
@pytest.mark.parametrize("source", [attention.SOURCE, quant_gemm.SOURCE], ids=lambda p: p.name)
def test_kernels_compile_for_each_amd_family(family: int, source: Path) -> None:
    """The per-family branches of paged_attention.c and quant_gemm.c compile on any machine (syntax only: a
    full build is ~90 s), for an AVX512-BF16 target (Cooper Lake's ISA: GCC 10 has it), so that every kernel
    variant is expanded."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler is not None
    flags = [
        "-fsyntax-only",
        "-march=cooperlake",
        "-fopenmp",
        "-DASYNCENGINE_AMD_CPU",
        f"-DASYNCENGINE_CPU_FAMILY={family}",
    ]
    result = subprocess.run([compiler, *flags, str(source)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
