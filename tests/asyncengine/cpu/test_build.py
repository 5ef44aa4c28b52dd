"""cpu/build.py: the compiled-library cache is keyed by the C source and the headers beside it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from asyncengine.cpu import amx, attention, build, ops

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
