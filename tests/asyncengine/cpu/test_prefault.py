"""The CPU KV cache's pages are faulted in by a background thread (cpu/prefault.py): afterwards writing
every page takes no page fault, the contents are untouched, a ModelRunner starts and stops one, and a
prefaulted cache can sit on transparent huge pages (opt-in)."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from asyncengine.cpu import prefault
from asyncengine.worker.model_runner import zeros

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")

PAGES = 4096


def faults_writing_every_page(t: torch.Tensor) -> int:
    flat = t.view(torch.uint8).view(-1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    flat[:: prefault.PAGE].fill_(7)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_populated_pages_take_no_fault_and_keep_their_contents() -> None:
    fresh = zeros((PAGES * prefault.PAGE // 4,), torch.float32, torch.device("cpu"))
    assert faults_writing_every_page(fresh) >= PAGES // 2  # lazily zero-filled: a fault a page
    cache = zeros((PAGES * prefault.PAGE // 4,), torch.float32, torch.device("cpu"))
    cache[:10] = torch.arange(10.0)  # written before the populate: kept
    filler = prefault.Prefaulter([cache], step_bytes=1 << 20)
    if not filler.run():
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE")
    assert filler.populated == cache.numel() * 4
    assert torch.equal(cache[:10], torch.arange(10.0)) and not cache[10:].any()
    assert faults_writing_every_page(cache) < PAGES // 16


def test_close_stops_the_thread_between_steps() -> None:
    cache = zeros((PAGES * prefault.PAGE // 4,), torch.float32, torch.device("cpu"))
    filler = prefault.Prefaulter([cache], step_bytes=prefault.PAGE)
    filler._stop.set()  # as if closed before the first step
    assert filler.run() is False and filler.populated == 0
    filler.start()
    filler.close()
    assert filler._thread is not None and not filler._thread.is_alive()


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCENGINE_CPU_KV_PREFAULT", "0")
    assert not prefault.enabled()
    monkeypatch.setenv("ASYNCENGINE_CPU_KV_PREFAULT", "1")
    assert prefault.enabled()


def test_a_model_runner_prefaults_its_cache_and_stops_on_close(
    tiny_model_factory,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    monkeypatch.setenv("ASYNCENGINE_CPU_KV_PREFAULT", "1")  # tests/conftest.py turns it off elsewhere
    from asyncengine.config import EngineConfig
    from asyncengine.layers.parallel import ParallelContext
    from asyncengine.worker.model_runner import ModelRunner

    cfg = EngineConfig(model=str(tiny_model_factory("llama")), dtype="float32")
    runner = ModelRunner(cfg, ParallelContext(), torch.device("cpu"), torch.float32, 64)
    runner.init_cache(64)
    filler = runner.prefaulter
    assert filler is not None
    assert filler._thread is not None
    filler._thread.join(10)
    runner.close()
    assert not filler._thread.is_alive()
    expected = sum(t.numel() * t.element_size() for pair in runner.kv_caches for t in pair)
    assert filler.populated in (0, expected)  # 0: a kernel without MADV_POPULATE_WRITE


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        lines = f.readlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_a_prefaulted_cache_can_be_on_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCENGINE_CPU_KV_PREFAULT", "1")
    monkeypatch.delenv("ASYNCENGINE_CPU_KV_HUGEPAGES", raising=False)
    assert not prefault.huge_pages_enabled()  # opt-in
    monkeypatch.setenv("ASYNCENGINE_CPU_KV_HUGEPAGES", "1")
    assert prefault.huge_pages_enabled()
    monkeypatch.setenv("ASYNCENGINE_CPU_KV_PREFAULT", "0")
    assert not prefault.huge_pages_enabled()  # only with the prefault
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        thp = "[never]"
    if "[never]" in thp:
        pytest.skip("transparent huge pages are off on this system")
    cache = zeros((16 << 20,), torch.float32, torch.device("cpu"), huge_pages=True)  # 64 MiB
    cache[:10] = torch.arange(10.0)
    filler = prefault.Prefaulter([cache], step_bytes=8 << 20)
    if not filler.run():
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE")
    assert torch.equal(cache[:10], torch.arange(10.0)) and not cache[10:].any()
    # 2 MiB pages (not necessarily all: the kernel falls back to small ones where memory is fragmented)
    assert anon_huge_kib(cache.data_ptr()) > 0
    plain = zeros((16 << 20,), torch.float32, torch.device("cpu"))
    assert prefault.Prefaulter([plain]).run()
    assert anon_huge_kib(plain.data_ptr()) == 0
