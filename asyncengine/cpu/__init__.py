"""The CPU backend's ground floor: C kernels and what loads and drives them (the CPU counterpart of
asyncengine.cuda).

* csrc/: the C sources (paged attention, AMX prompt attention, AMX GEMMs, fused element-wise ops);
* build.py: compiles them on first use into a per-machine cache and loads them with ctypes;
* ops.py, gemm.py, amx.py, attention.py: the ctypes wrappers (fused ops; packed-weight GEMMs; AMX GEMMs;
  the paged- and prompt-attention kernels);
* kernel_graph.py: CPU decode steps captured as recorded kernel calls and replayed per batch size.

Nothing here imports asyncengine.layers, .models, .worker or .engine: the layers pick a backend and
import from here, never the other way round (tests/asyncengine/test_layering.py checks it).
Submodules are imported on use; importing this package loads nothing.
"""
