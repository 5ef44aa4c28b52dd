"""The compiled CPU paged-attention kernel against the PyTorch reference."""

from __future__ import annotations

import random

import pytest
import torch

from asyncengine.cpu import amx
from asyncengine.cpu.attention import load_kernel_library
from asyncengine.layers.attention import AttentionMetadata, write_kv_cache
from asyncengine.layers.attention_cpu import CpuAttentionBackend
from asyncengine.layers.attention_torch import TorchAttentionBackend

pytestmark = pytest.mark.skipif(load_kernel_library() is None, reason="no C compiler")


def build_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random q/k/v for a batch whose sequence i has context_lens[i] cached tokens and query_lens[i] new."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous, out-of-order block tables
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    slots = []
    for i, (c, s) in enumerate(zip(context_lens, seq_lens)):
        blocks = [free.pop() for _ in range(-(-s // block_size))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        for p in range(c, s):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
    t = sum(query_lens)
    q = torch.randn(t, num_heads, head_dim).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim).to(dtype)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor(slots))
    qs = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        torch.tensor(slots),
        qs,
        torch.tensor(seq_lens, dtype=torch.int32),
        tables,
        list(query_lens),
        seq_lens,
        max(query_lens),
        max(seq_lens),
    )
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1, 1, 1, 1], [0, 15, 16, 70]),  # decode, crossing block boundaries
        ([5, 1, 33], [20, 40, 0]),  # chunked prefill with context, a decode and a fresh prefill
        ([17, 9], [0, 0]),  # fresh prefills only
        ([20, 1, 16], [30, 50, 1]),  # prompt chunks after cached context (the SDPA path) and a decode
    ],
)
def test_kernel_matches_reference_fp32(head_dim, heads, block_size, query_lens, context_lens) -> None:
    num_heads, num_kv_heads = heads
    q, k, v, kc, vc, meta = build_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32
    )
    scale = head_dim**-0.5
    ref = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, scale)
    got = CpuAttentionBackend().forward(q, k, v, kc, vc, meta, scale)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_kernel_bf16_close_to_fp32_reference() -> None:
    q, k, v, kc, vc, meta = build_batch([1, 4, 1], [30, 12, 100], 8, 2, 64, 16, torch.bfloat16)
    ref = TorchAttentionBackend().forward(
        q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, 0.125
    )
    got = CpuAttentionBackend().forward(q, k, v, kc, vc, meta, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_padding_rows_read_nothing() -> None:
    q, k, v, kc, vc, meta = build_batch([1, 1], [10, 20], 4, 2, 64, 16, torch.float32)
    # a padded decode batch: two more rows with seq_len 0 must come back as zeros
    pad = AttentionMetadata(
        meta.slot_mapping,
        torch.arange(5, dtype=torch.int32),
        torch.tensor([11, 21, 0, 0], dtype=torch.int32),
        torch.cat([meta.block_tables, torch.zeros(2, meta.block_tables.shape[1], dtype=torch.int32)]),
        [1] * 4,
        [11, 21, 0, 0],
        1,
        21,
    )
    q4 = torch.cat([q, torch.randn(2, 4, 64)])
    got = CpuAttentionBackend().forward(q4, k, v, kc, vc, pad, 0.125)
    ref = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.125)
    torch.testing.assert_close(got[:2], ref, atol=1e-5, rtol=1e-4)
    assert torch.all(got[2:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,head_dim",
    [((4, 4), 64), ((8, 2), 80), ((12, 12), 64), ((14, 2), 64), ((6, 2), 64), ((10, 2), 128), ((24, 4), 64)],
)
def test_both_builds_match_reference(dtype, heads, head_dim) -> None:
    """The AVX-512 build (where the CPU has it) and the portable build both match the reference, with
    enough rows and heads that the work splits into head runs and long contexts cross many blocks. The
    value pass takes a KV head's group of 3, 5, 6 or 7 heads (6 / 10 / 24 / 14 heads over 2-4 KV heads) in
    one run, of 4 heads and over in runs of 8, 4, 2, 1 (a 16-head chunk cuts 24 over 4's third group)."""
    num_heads, num_kv_heads = heads
    q, k, v, kc, vc, meta = build_batch(
        [1, 1, 1, 3, 1], [0, 17, 64, 40, 300], num_heads, num_kv_heads, head_dim, 16, dtype
    )
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, 0.1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for lib in (load_kernel_library(), load_kernel_library(portable=True)):
        got = CpuAttentionBackend(lib).forward(q, k, v, kc, vc, meta, 0.1)
        torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "heads,head_dim",
    [
        ((16, 2), 64),
        ((20, 2), 64),
        ((40, 8), 64),
        ((12, 4), 32),
        ((16, 2), 96),
        ((32, 2), 128),
        ((15, 3), 64),
    ],
)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("window", [None, 37])
def test_grouped_heads_with_keys_in_lanes(heads, head_dim, block_size, window) -> None:
    """bfloat16 decode scores of a KV head's 5+ heads (head_dim 64; 3+ at 32, 8+ at 96, 10+ at 128) take
    16 keys at a time with the keys in the vector lanes (paged_attention.c's lane_dots): runs of 8 heads
    and a rest (20 over 2), 16-head chunks cut inside a KV head's group (15 over 3, 40 over 8), keys past a
    block's last 16 (17, 40, 100 keys), windows starting inside a block, on one thread and on two."""
    num_heads, num_kv_heads = heads
    context_lens = [0, 16, 40, 100, 300, 17, 5]
    q, k, v, kc, vc, meta = build_batch(
        [1] * 7, context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16
    )
    ref = TorchAttentionBackend().forward(
        q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, 0.1, window
    )
    previous = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            got = CpuAttentionBackend().forward(q, k, v, kc, vc, meta, 0.1, window)
            torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    finally:
        torch.set_num_threads(previous)


def windowed_brute_force(q, kc, vc, meta, scale, window):
    """Row by row: the query at position p over keys max(0, p - window + 1) .. p, in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    block_size, group = kc.shape[1], q.shape[1] // kc.shape[2]
    row = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        slots = [
            int(meta.block_tables[i, p // block_size]) * block_size + p % block_size for p in range(seq_len)
        ]
        keys = kc.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [seq_len, H, D]
        values = vc.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        for j in range(q_len):
            pos = seq_len - q_len + j
            lo = max(0, pos - window + 1)
            scores = torch.einsum("hd,khd->hk", q[row].double(), keys[lo : pos + 1]) * scale
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[lo : pos + 1])
            row += 1
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_sliding_window(dtype, window, num_threads) -> None:
    """Each query sees only its last `window` keys: decode rows (windows starting mid-block), a multi-row
    kernel chunk, prompt chunks after context (SDPA with a mask) and a fresh prefill, with prefix-shared
    blocks (which must not be read as a group past a window); both builds, against a brute force."""
    q, k, v, kc, vc, meta = build_batch(
        [1, 1, 1, 5, 20, 17, 1, 1], [0, 9, 100, 37, 30, 0, 70, 70], 8, 2, 64, 16, dtype
    )
    meta.block_tables[7, :3] = meta.block_tables[6, :3]  # two sequences sharing a 48-token prefix
    expected = windowed_brute_force(q, kc, vc, meta, 0.1, window)
    ref = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.1, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ref.double(), expected, atol=tol, rtol=tol)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for lib in (load_kernel_library(), load_kernel_library(portable=True)):
            got = CpuAttentionBackend(lib).forward(q, k, v, kc, vc, meta, 0.1, window)
            torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((12, 12), 64), ((14, 2), 64), ((8, 2), 128), ((6, 3), 80)])
@pytest.mark.parametrize("block_size", [16, 15])
@pytest.mark.parametrize("window", [None, 23])
def test_decode_reads_no_slot_past_its_keys(dtype, heads, head_dim, block_size, window) -> None:
    """Every cache slot that no row reads holds NaN: decode rows of odd and even lengths, windows starting
    at odd and even offsets inside a block, odd block sizes, four rows sharing a prefix (walked as a
    group). The output must match a float64 brute force on the clean caches: a kernel that read one slot
    too far (on AMD Zen 4 the bfloat16 values pass takes keys in pairs, an odd last key with a zero
    partner) would give NaN, however small the weight it multiplied that slot by."""
    num_heads, num_kv_heads = heads
    context_lens = [0, 1, 14, 15, 16, 30, 47, 100, 64, 64, 64, 64]
    q, k, v, kc, vc, meta = build_batch(
        [1] * 12, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=3
    )
    for i in (9, 10, 11):  # rows 8-11 share their first 4 blocks (60 or 64 keys)
        meta.block_tables[i, :4] = meta.block_tables[8, :4]
    read = torch.zeros(kc.shape[0] * block_size, dtype=torch.bool)
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        lo = 0 if window is None else max(0, seq_len - window)
        for p in range(lo, seq_len):
            read[int(meta.block_tables[i, p // block_size]) * block_size + p % block_size] = True
    expected = windowed_brute_force(q, kc, vc, meta, 0.1, window or 1 << 30)
    poisoned_k, poisoned_v = kc.clone().flatten(0, 1), vc.clone().flatten(0, 1)
    poisoned_k[~read], poisoned_v[~read] = float("nan"), float("nan")
    poisoned_k, poisoned_v = poisoned_k.view_as(kc), poisoned_v.view_as(vc)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    previous = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for lib in (load_kernel_library(), load_kernel_library(portable=True)):
                got = CpuAttentionBackend(lib).forward(q, k, v, poisoned_k, poisoned_v, meta, 0.1, window)
                torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(previous)


def quantize(q, k, v, kc, vc):
    """What the Attention layer does with kv_cache_dtype=fp8_e5m2: caches in e5m2, this step's K/V as
    stored."""
    e5m2 = torch.float8_e5m2
    return q, k.to(e5m2).to(q.dtype), v.to(e5m2).to(q.dtype), kc.to(e5m2), vc.to(e5m2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,head_dim,block_size", [((4, 4), 64, 16), ((8, 2), 80, 32), ((12, 12), 64, 16)]
)
def test_fp8_cache_matches_reference(dtype, heads, head_dim, block_size) -> None:
    num_heads, num_kv_heads = heads
    batch = build_batch(
        [1, 1, 5, 20, 1, 17], [0, 40, 12, 30, 300, 0], num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    q, k, v, kc, vc = quantize(*batch[:5])
    meta = batch[5]
    ref = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.1)
    # the reference on a float8 cache is the reference on its widened copy
    widened = TorchAttentionBackend().forward(q, k, v, kc.to(dtype), vc.to(dtype), meta, 0.1)
    torch.testing.assert_close(ref, widened, atol=0, rtol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for lib in (load_kernel_library(), load_kernel_library(portable=True)):
        got = CpuAttentionBackend(lib).forward(q, k, v, kc, vc, meta, 0.1)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_widening_is_exact(dtype) -> None:
    """One key: softmax is 1 and the output is the cached value itself, so every finite e5m2 byte must
    come back as torch widens it (subnormals, zeros and both signs included), in both builds."""
    codes = [b for b in range(256) if (b >> 2) & 0x1F != 0x1F]  # 248 finite codes; inf / NaN excluded
    codes += [0] * (256 - len(codes))
    vc = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e5m2).view(1, 1, 2, 128)
    vc = torch.cat([torch.zeros_like(vc), vc])  # block 1 holds the key
    kc = torch.zeros_like(vc)
    meta = AttentionMetadata(
        torch.tensor([16]),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([[1]], dtype=torch.int32),
        [1],
        [1],
        1,
        1,
    )
    q = torch.randn(1, 2, 128).to(dtype)
    k, v = kc[1].to(dtype), vc[1].to(dtype)
    for lib in (load_kernel_library(), load_kernel_library(portable=True)):
        got = CpuAttentionBackend(lib).forward(q, k, v, kc, vc, meta, 0.1)
        assert torch.equal(got[0].float(), vc[1, 0].float())


def share_prefix(tables: torch.Tensor, members: list[int], num_blocks: int) -> None:
    """Points sequences `members[1:]` at the first `num_blocks` cache blocks of members[0], as prefix caching
    does for requests with a common prompt (their own first blocks then hold nothing they read)."""
    for i in members[1:]:
        tables[i, :num_blocks] = tables[members[0], :num_blocks]


def unshare(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor):
    """The same batch with every table entry on a block of its own: copies of the shared blocks."""
    entries = tables.flatten().tolist()
    fresh = torch.arange(len(entries), dtype=torch.int32).view_as(tables)
    return k_cache[entries].clone(), v_cache[entries].clone(), fresh


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,head_dim", [((4, 4), 64), ((8, 2), 80), ((12, 12), 64), ((14, 2), 64), ((6, 2), 64), ((12, 2), 96)]
)
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_shared_prefix_blocks_change_no_bit(dtype, heads, head_dim, num_threads) -> None:
    """Prefix caching points many sequences at the same physical blocks: the kernel must give, bit for
    bit, what it gives on the same batch with the shared blocks copied per sequence, and match the
    reference, whatever the thread count (the work split into head runs depends on it). Covers groups
    with different shared lengths, a sequence that shares less than the others, one too short to share a
    whole block, a multi-row chunk and a fresh prefill left to SDPA."""
    num_heads, num_kv_heads = heads
    query_lens = [1] * 40 + [5, 20, 1, 1]
    context_lens = [100 + 7 * i for i in range(40)] + [40, 0, 9, 70]
    q, k, v, kc, vc, meta = build_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype
    )
    share_prefix(meta.block_tables, list(range(0, 30)), 4)  # a 64-token prefix common to 30 requests
    share_prefix(meta.block_tables, [0, 30, 31], 2)  # two more that share only its first 32 tokens
    share_prefix(meta.block_tables, [32, 33, 34, 35], 6)  # another prompt, 96 tokens, four requests
    share_prefix(meta.block_tables, [32, 43], 3)
    share_prefix(meta.block_tables, [36, 42], 1)  # 42 has 10 keys: no whole block to share
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, 0.1)
    kc2, vc2, tables2 = unshare(kc, vc, meta.block_tables)
    meta2 = AttentionMetadata(
        meta.slot_mapping,
        meta.query_start_loc,
        meta.seq_lens,
        tables2,
        meta.query_lens_cpu,
        meta.seq_lens_cpu,
        meta.max_query_len,
        meta.max_seq_len,
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        got = CpuAttentionBackend().forward(q, k, v, kc, vc, meta, 0.1)
        alone = CpuAttentionBackend().forward(q, k, v, kc2, vc2, meta2, 0.1)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got, alone)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((12, 12), 64), ((8, 2), 80), ((16, 4), 64), ((14, 2), 64)])
@pytest.mark.parametrize("window", [None, 1100])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_long_rows_give_the_same_bits_in_any_batch(dtype, heads, head_dim, window, num_threads) -> None:
    """Rows longer than a segment (1024 keys) are cut into segments whose partial softmax states are merged
    (flash-decoding). A row alone is split into work items per segment; in a full batch each row walks its
    segments in one item, and a prefix-sharing group flushes inside its shared blocks (a 1120-token prefix
    here). Every sequence computed alone must equal its rows in the batch bit for bit, and the reference."""
    num_heads, num_kv_heads = heads
    query_lens = [1] * 36 + [3, 1, 1, 1]
    context_lens = [3000, 1025, 1024, 1023] + [1150 + 37 * i for i in range(32)] + [2100, 1, 40, 2300]
    q, k, v, kc, vc, meta = build_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype
    )
    if window is None:
        share_prefix(meta.block_tables, list(range(4, 14)), 70)
    ref = TorchAttentionBackend().forward(
        q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, 0.1, window
    )
    qs = meta.query_start_loc.tolist()
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        got = CpuAttentionBackend().forward(q, k, v, kc, vc, meta, 0.1, window)
        for i in [0, 1, 2, 3, 4, 5, 20, 36, 39]:
            alone = AttentionMetadata(
                meta.slot_mapping[qs[i] : qs[i + 1]],
                torch.tensor([0, query_lens[i]], dtype=torch.int32),
                meta.seq_lens[i : i + 1],
                meta.block_tables[i : i + 1],
                [query_lens[i]],
                [meta.seq_lens_cpu[i]],
                query_lens[i],
                meta.seq_lens_cpu[i],
            )
            one = CpuAttentionBackend().forward(
                q[qs[i] : qs[i + 1]], k[qs[i] : qs[i + 1]], v[qs[i] : qs[i + 1]], kc, vc, alone, 0.1, window
            )
            assert torch.equal(one, got[qs[i] : qs[i + 1]]), f"sequence {i}"
    finally:
        torch.set_num_threads(previous)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def amx_scores_available() -> bool:
    lib = load_kernel_library()
    return lib is not None and bool(lib.paged_attention_use_amx(int(amx.allowed())))


@pytest.mark.skipif(not amx_scores_available(), reason="no AMX-BF16 (or ASYNCENGINE_CPU_AMX=0)")
@pytest.mark.parametrize(
    "heads,head_dim,block_size", [((16, 4), 64, 16), ((24, 8), 64, 32), ((8, 2), 128, 16), ((9, 3), 96, 16)]
)
def test_amx_scores_agree_with_the_vector_path(heads, head_dim, block_size) -> None:
    """Grouped-query decode scores on AMX tiles (csrc/paged_attention.c's amx_scores) against the AVX-512
    path on the same batch, to bfloat16 rounding, and against the reference: rows of 1-3000 keys (partial
    tiles, several segments), a multi-row chunk, a shared prefix (rows walked 4, 2 and 1 at a time), 24
    heads over 8 KV heads (a 16-head chunk cuts a KV head's group in two), 32-key blocks (two tiles a block)
    and 128- and 96-wide heads."""
    lib = load_kernel_library()
    num_heads, num_kv_heads = heads
    query_lens = [1] * 20 + [7, 1]
    context_lens = [1 + 53 * i for i in range(20)] + [90, 3000]
    q, k, v, kc, vc, meta = build_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16
    )
    share_prefix(meta.block_tables, list(range(10, 19)), 200 // block_size)
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, 0.1)
    try:
        assert lib.paged_attention_use_amx(0) == 0
        vector = CpuAttentionBackend(lib).forward(q, k, v, kc, vc, meta, 0.1)
        assert lib.paged_attention_use_amx(1) == 1
        tiles = CpuAttentionBackend(lib).forward(q, k, v, kc, vc, meta, 0.1)
    finally:
        lib.paged_attention_use_amx(int(amx.allowed()))
    # the tile path ran: its sums, added in another order, round differently somewhere in these outputs
    assert not torch.equal(tiles, vector)
    torch.testing.assert_close(tiles.float(), vector.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(tiles.float(), ref, atol=2e-2, rtol=2e-2)
