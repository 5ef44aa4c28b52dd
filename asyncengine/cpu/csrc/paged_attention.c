/* Paged attention on the CPU, reading K/V in place from the block-paged cache (no gather copies).
 *
 * For every query row r of sequence i (rows query_start[i] .. query_start[i+1]) and every head h,
 * attends causally over the first  n = seq_len[i] - q_len[i] + (r - query_start[i]) + 1  cached keys
 * (with a sliding window W > 0: over the last min(n, W) of them), with an online softmax one cache
 * block at a time.
 *
 * The portable build: one OpenMP task handles one query row and the heads that share a KV head. It
 * walks the keys in cache order, so each key's [head_dim] vector is loaded once for all those heads.
 * The AVX-512 build: one task handles a group of rows that share leading blocks and a run of KV heads
 * (see RowGroup below).
 * Layouts (contiguous): q/out [T, H, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D], in the
 * query's dtype or (the *_e5m2 kernels) float8 e5m2 bytes, widened in registers;
 * block_tables [B, max_blocks] int32; query_start [B + 1] int32; seq_lens [B] int32; skip [B] or NULL.
 * Built at run time by asyncengine/cpu/attention.py with gcc -O3 -march=native -fopenmp.
 *
 * Two implementations behind the same symbols, chosen at compile time: an AVX-512 one (x86 with
 * AVX512F/BW/VL) and a portable one that the compiler vectorises as it can. The AVX-512 one widens
 * bf16 K/V in registers (or, with AVX512-BF16, takes bfloat16 q.k with vdpbf16ps: 10% faster where the
 * keys are in cache, as a shared prefix's are), reduces a key's q.k dots with 16 heads together in one
 * shuffle tree, runs the online softmax on 16 heads a vector with a polynomial exp (Cephes' expf, ~1 ulp)
 * instead of one libm expf call per key, splits each 64-byte bf16 V load into its even and odd dims with
 * two ALU ops, and prefetches a pass ahead (a block's V during its q.k, the next block during p.v):
 * 2-2.5x the portable one's speed (the shuffle tree, the softmax layout and the V split took a bfloat16
 * layer at batch 64 from 2.47 to 2.32 ms cold and from 0.87 to 0.74 ms with the keys in cache).
 * Grouped-query attention (several heads a KV head) has that many times the arithmetic per byte of K/V and
 * had made the kernel compute-bound (16 heads over 4 KV heads: 18 GB/s with K/V in cache against ~50 for
 * 12 full heads): the p.v pass widens a V chunk once for all the heads of its KV head, and with a
 * bfloat16 cache on an AMX CPU and 3+ heads a KV head the scores run on AMX tiles (amx_scores below; 16
 * over 4 heads 41 GB/s in cache, 8 over 2 heads 0.60 -> 0.38 ms a layer at batch 64 x 256 keys out of
 * cache). ASYNCENGINE_CPU_AMX=0 keeps the AVX-512 path (cpu/attention.py calls paged_attention_use_amx).
 * Without AMX, a KV head with heads enough for its head_dim takes its scores 16 keys at a time with the
 * keys in the vector lanes, one transpose shared by its heads (lane_dots below: Qwen2.5-0.5B's 14 heads over
 * 2, 0.41 -> 0.30 ms a layer at batch 64 x 256 keys out of cache).
 */
#include <stdlib.h>

#include "cpu_common.h"

#define MAX_HEAD_DIM 512
#define MAX_BLOCK 256
#define MAX_GROUP 64
/* Heads a KV head from which the decode scores run on AMX tiles (amx_scores): with fewer, most of each tile
 * product is zero columns, and out of cache the tile loads wait on K rows the AVX-512 loop would overlap
 * (bfloat16, batch 64 x 256 keys: 8 heads over 4 KV heads 0.97-0.99 ms a layer on tiles against 0.90;
 * 12 over 4 1.02 against 1.05-1.12; 12 full heads 45 against 51 GB/s even in cache). */
#ifndef MIN_AMX_GROUP
#define MIN_AMX_GROUP 3
#endif

#define DEFINE_KERNEL(NAME, T, KT, LOAD, KLOAD, STORE)                                                  \
int NAME(const T *q, const KT *k_cache, const KT *v_cache, T *out, const int32_t *block_tables,             \
         const int32_t *query_start, const int32_t *seq_lens, const uint8_t *skip, int num_seqs,          \
         int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,      \
         int window, int num_threads) {                                                                 \
    const int group = num_heads / num_kv_heads;                                                         \
    if (head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || group > MAX_GROUP) return -1;              \
    const int num_rows = query_start[num_seqs];                                                         \
    const long total = (long)num_rows * num_kv_heads;                                                   \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel for schedule(dynamic, 2) num_threads(num_threads)")                          \
    for (long work = 0; work < total; work++) {                                                         \
        const int row = (int)(work / num_kv_heads), kvh = (int)(work % num_kv_heads);                   \
        int lo = 0, hi = num_seqs - 1; /* the sequence owning `row`: binary search on query_start */    \
        while (lo < hi) { int mid = (lo + hi + 1) / 2; if (query_start[mid] <= row) lo = mid; else hi = mid - 1; } \
        const int i = lo;                                                                               \
        if (skip && skip[i]) continue; /* left to the caller (fresh prefills go to SDPA) */             \
        const int q_len = query_start[i + 1] - query_start[i];                                          \
        const int n_keys = seq_lens[i] - q_len + (row - query_start[i]) + 1;                            \
        float *buf = (float *)malloc(sizeof(float) * (size_t)group * (2 * head_dim + block_size));       \
        if (!buf) { failed = 1; continue; }                                                             \
        float *qf = buf, *acc = buf + group * head_dim, *scores = acc + group * head_dim;               \
        float m[MAX_GROUP], s[MAX_GROUP];                                                               \
        for (int g = 0; g < group; g++) {                                                               \
            const T *qp = q + ((long)row * num_heads + kvh * group + g) * head_dim;                     \
            for (int d = 0; d < head_dim; d++) { qf[g * head_dim + d] = LOAD(qp[d]) * scale; acc[g * head_dim + d] = 0.f; } \
            m[g] = -INFINITY; s[g] = 0.f;                                                               \
        }                                                                                               \
        const int32_t *table = block_tables + (long)i * max_blocks;                                     \
        for (int start = window > 0 && n_keys > window ? n_keys - window : 0, n; start < n_keys; start += n) { \
            const int off = start % block_size; /* nonzero only where a sliding window starts */         \
            n = n_keys - start < block_size - off ? n_keys - start : block_size - off;                  \
            const long base = (long)table[start / block_size] * block_size + off;                       \
            for (int t = 0; t < n; t++) {                                                               \
                const KT *kp = k_cache + ((base + t) * num_kv_heads + kvh) * head_dim;                  \
                for (int g = 0; g < group; g++) {                                                       \
                    const float *qg = qf + g * head_dim;                                                \
                    float dot = 0.f;                                                                    \
                    _Pragma("omp simd reduction(+:dot)") /* vectorise without -ffast-math */            \
                    for (int d = 0; d < head_dim; d++) dot += qg[d] * KLOAD(kp[d]);                     \
                    scores[g * block_size + t] = dot;                                                   \
                }                                                                                       \
            }                                                                                           \
            for (int g = 0; g < group; g++) { /* rescale what was accumulated under the old maximum */  \
                float bm = -INFINITY;                                                                   \
                for (int t = 0; t < n; t++) if (scores[g * block_size + t] > bm) bm = scores[g * block_size + t]; \
                if (bm > m[g]) {                                                                        \
                    const float c = expf(m[g] - bm);                                                    \
                    s[g] *= c;                                                                          \
                    for (int d = 0; d < head_dim; d++) acc[g * head_dim + d] *= c;                      \
                    m[g] = bm;                                                                          \
                }                                                                                       \
                for (int t = 0; t < n; t++) {                                                           \
                    const float p = expf(scores[g * block_size + t] - m[g]);                            \
                    scores[g * block_size + t] = p;                                                     \
                    s[g] += p;                                                                          \
                }                                                                                       \
            }                                                                                           \
            for (int t = 0; t < n; t++) {                                                               \
                const KT *vp = v_cache + ((base + t) * num_kv_heads + kvh) * head_dim;                  \
                for (int g = 0; g < group; g++) {                                                       \
                    const float p = scores[g * block_size + t];                                         \
                    float *ag = acc + g * head_dim;                                                     \
                    for (int d = 0; d < head_dim; d++) ag[d] += p * KLOAD(vp[d]);                       \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        for (int g = 0; g < group; g++) {                                                               \
            T *op = out + ((long)row * num_heads + kvh * group + g) * head_dim;                         \
            const float inv = s[g] > 0.f ? 1.f / s[g] : 0.f;                                            \
            for (int d = 0; d < head_dim; d++) op[d] = STORE(acc[g * head_dim + d] * inv);              \
        }                                                                                               \
        free(buf);                                                                                      \
    }                                                                                                   \
    return failed ? -2 : 0;                                                                             \
}


/* ---- Decode scores on AMX tiles, for grouped-query attention ----
 * With several query heads a KV head, the q.k dots are most of the kernel's arithmetic per byte of K/V (16
 * heads over 4 KV heads: 4 dots for each 64-dim key row read), and the AVX-512 path pays a horizontal
 * reduction per key and head. On AMX, 16 keys' scores for 16 heads are one float32 tile,
 *     S [16 keys][16 heads] = sum over the KV heads h covering those heads of  K_h [16 keys][D] x Q_h^T [D][16],
 * where K_h is read straight from the cache (16 key rows, the cache's row stride) and Q_h^T is the row's
 * query packed once per call as B tiles holding only the heads of KV head h (zero columns for the others,
 * so that each head's sum has its own KV head's products only). The tile is stored in the layout the
 * online softmax takes (per key, 16 heads in a vector). The products of two bfloat16 are exact in float32;
 * the additions run in the tile unit's order, so scores can differ from the AVX-512 path's in the last
 * bits: the choice depends only on the shape (heads, head_dim, block size), never on the batch. */
#if defined(HAVE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)        \
    && defined(__linux__)
#include "amx_common.h" /* request_tiles, configure_tiles, TILE */
#define HAVE_AMX_SCORES 1
static int amx_scores_on = 0, amx_granted = -1; /* -1: tile state not asked for yet */
/* Turns the AMX scores on or off (cpu/attention.py, at load); returns whether they are on. */
int paged_attention_use_amx(int on) {
    amx_scores_on = on;
    return on;
}
/* Linux's tile state, asked for by the first call that would use it: a worker whose attention never runs on
 * AMX (float32, full heads) never asks. */
static inline int amx_ready(void) {
    int granted = __atomic_load_n(&amx_granted, __ATOMIC_RELAXED);
    if (granted < 0) {
        granted = request_tiles();
        __atomic_store_n(&amx_granted, granted, __ATOMIC_RELAXED);
    }
    return granted;
}
static inline void amx_begin(void) { configure_tiles(16); }
static inline void amx_end(void) { _tile_release(); }
/* The KV heads (first, last) whose heads fall in the 16-head chunk from head c0 of hg. */
static inline int chunk_first(int c0, int group) { return c0 / group; }
static inline int chunk_last(int c0, int hg, int group) {
    return ((c0 + 16 < hg ? c0 + 16 : hg) - 1) / group;
}
/* B tiles of a row's query over hg heads (head_dim / 32 per KV head of each 16-head chunk). */
static int qt_tiles(int hg, int group, int head_dim) {
    int n = 0;
    for (int c0 = 0; c0 < hg; c0 += 16)
        n += (chunk_last(c0, hg, group) - chunk_first(c0, group) + 1) * (head_dim / 32);
    return n;
}
/* q [hg][head_dim] bfloat16 -> qt: per chunk, per KV head h, per 32 dims a B tile [16 dim pairs][16 heads][2]
 * with the chunk's heads of h in their columns and zero elsewhere. */
static void pack_qt(uint16_t *qt, const uint16_t *q, int hg, int group, int head_dim) {
    for (int c0 = 0; c0 < hg; c0 += 16)
        for (int h = chunk_first(c0, group); h <= chunk_last(c0, hg, group); h++)
            for (int db = 0; db < head_dim / 32; db++, qt += TILE) {
                uint32_t *t = (uint32_t *)qt; /* [16 pairs][16 columns] */
                memset(t, 0, 1024);
                for (int x = c0; x < c0 + 16 && x < hg; x++)
                    if (x / group == h) {
                        const uint16_t *qx = q + (long)x * head_dim + db * 32;
                        for (int p = 0; p < 16; p++) memcpy(t + p * 16 + (x - c0), qx + 2 * p, 4);
                    }
            }
}
/* scores [hg / 16][sb][16] (scaled) of n <= sb keys from kb (the block's first key at the run's first KV
 * head; rows kv_stride elements apart, whole 16-key tiles readable) against the packed query qt; the rows
 * at pf (this block's V rows, row_bytes each; NULL: none) are prefetched between the tiles. */
static inline void amx_scores(const uint16_t *qt, const uint16_t *kb, const char *pf, float *scores,
                              int n, int hg, int group, int head_dim, int sb, long kv_stride, long row_bytes,
                              float scale) {
    const __m512 sc = _mm512_set1_ps(scale);
    const int DB = head_dim / 32;
    for (int c0 = 0; c0 < hg; c0 += 16) {
        const int h0 = chunk_first(c0, group), h1 = chunk_last(c0, hg, group);
        float *out = scores + (size_t)c0 * sb;
        for (int t0 = 0; t0 < n; t0 += 16) {
            _tile_zero(0);
            int i = 0;
            for (int h = h0; h <= h1; h++)
                for (int db = 0; db < DB; db++, i++) {
                    const uint16_t *a = kb + t0 * kv_stride + h * head_dim + db * 32,
                                   *b = qt + (size_t)i * TILE;
                    /* alternate operand tiles, so that a load need not wait on the last product */
                    if (i & 1) {
                        _tile_loadd(5, a, kv_stride * 2);
                        _tile_loadd(7, b, 64);
                        _tile_dpbf16ps(0, 5, 7);
                    } else {
                        _tile_loadd(4, a, kv_stride * 2);
                        _tile_loadd(6, b, 64);
                        _tile_dpbf16ps(0, 4, 6);
                    }
                }
            if (pf && c0 == 0)
                for (int t = t0; t < n && t < t0 + 16; t++)
                    for (long l = 0; l < row_bytes; l += 64)
                        _mm_prefetch(pf + t * kv_stride * 2 + l, _MM_HINT_T1);
            _tile_stored(0, out + t0 * 16, 64);
            for (int t = t0; t < n && t < t0 + 16; t++)
                _mm512_store_ps(out + t * 16, _mm512_mul_ps(_mm512_load_ps(out + t * 16), sc));
        }
        qt += (size_t)(h1 - h0 + 1) * DB * TILE;
    }
}
#else
#define HAVE_AMX_SCORES 0
#define amx_scores_on 0
/* clang-format off */
int paged_attention_use_amx(int on) { (void)on; return 0; }
static inline int amx_ready(void) { return 0; }
static inline void amx_begin(void) {}
static inline void amx_end(void) {}
static inline int qt_tiles(int hg, int group, int head_dim) { (void)hg; (void)group; (void)head_dim; return 0; }
static inline void pack_qt(uint16_t *qt, const uint16_t *q, int hg, int group, int head_dim) {
    (void)qt; (void)q; (void)hg; (void)group; (void)head_dim;
}
static inline void amx_scores(const uint16_t *qt, const uint16_t *kb, const char *pf, float *scores,
                              int n, int hg, int group, int head_dim, int sb, long kv_stride, long row_bytes,
                              float scale) {
    (void)qt; (void)kb; (void)pf; (void)scores; (void)n; (void)hg; (void)group; (void)head_dim; (void)sb;
    (void)kv_stride; (void)row_bytes; (void)scale;
}
/* clang-format on */
#endif

#ifdef HAVE_AVX512

/* load16_f32 / load16_bf16 / load16_e5m2 (cpu_common.h): 16 cache elements as float32, zero past head_dim. */
static inline void store_f32(float *p, float x) { *p = x; }
static inline void store_bf16(uint16_t *p, float x) { *p = f32_to_bf16(x); }

/* Rows that read the same leading cache blocks form a group: prefix caching hands one prompt's blocks to
 * every request that starts with it, and the rows of a multi-token chunk share all of theirs. A group
 * walks its shared blocks once, every row of it in turn on each block while the block is in L1/L2, so
 * a 256-token prefix common to 50 decoding sequences is read from DRAM once a step instead of 50 times.
 * Each row still takes its blocks in order with the same arithmetic: grouping changes no result bit. */
typedef struct { int first, count, shared; } RowGroup; /* rows order[first .. first+count), `shared` blocks */

static int cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* The kernel's rows (skipped sequences left out), grouped; returns the number of groups or -1 (no memory).
 * row_seq / row_keys [num_rows]: each row's sequence and its number of keys. Rows with a full first block
 * are sorted by that block id; a run of equal ones is cut into groups of at most max_group rows, each
 * sharing the blocks all its rows' tables agree on (and that each of them reads whole). */
static int group_rows(const int32_t *block_tables, const int32_t *query_start, const int32_t *seq_lens,
                      const uint8_t *skip, int num_seqs, int max_blocks, int block_size, int max_group,
                      int *row_seq, int *row_keys, int *order, RowGroup *groups) {
    const int num_rows = query_start[num_seqs];
    uint64_t *keys = (uint64_t *)malloc(sizeof(uint64_t) * (size_t)(num_rows > 0 ? num_rows : 1));
    if (!keys) return -1;
    int n_groups = 0, n_keyed = 0, n_order = 0;
    for (int i = 0; i < num_seqs; i++) {
        const int q_len = query_start[i + 1] - query_start[i];
        for (int r = query_start[i]; r < query_start[i + 1]; r++) {
            row_seq[r] = i;
            row_keys[r] = seq_lens[i] - q_len + (r - query_start[i]) + 1;
            if (skip && skip[i]) continue;
            if (row_keys[r] >= block_size)
                keys[n_keyed++] =
                    ((uint64_t)(uint32_t)block_tables[(long)i * max_blocks] << 32) | (uint32_t)r;
            else { /* nothing whole to share: a group of its own */
                groups[n_groups++] = (RowGroup){n_order, 1, 0};
                order[n_order++] = r;
            }
        }
    }
    qsort(keys, (size_t)n_keyed, sizeof(uint64_t), cmp_u64);
    for (int a = 0; a < n_keyed;) {
        int b = a + 1;
        while (b < n_keyed && b - a < max_group && keys[b] >> 32 == keys[a] >> 32) b++;
        const int r0 = (int)(uint32_t)keys[a];
        const int32_t *t0 = block_tables + (long)row_seq[r0] * max_blocks;
        int shared = row_keys[r0] / block_size;
        for (int j = a + 1; j < b; j++) {
            const int r = (int)(uint32_t)keys[j];
            const int32_t *t = block_tables + (long)row_seq[r] * max_blocks;
            int lim = row_keys[r] / block_size, c = 0;
            if (lim > shared) lim = shared;
            while (c < lim && t[c] == t0[c]) c++;
            shared = c;
        }
        if (b - a > 1 && shared > 0) {
            groups[n_groups++] = (RowGroup){n_order, b - a, shared};
            for (int j = a; j < b; j++) order[n_order++] = (int)(uint32_t)keys[j];
        } else
            for (int j = a; j < b; j++) {
                groups[n_groups++] = (RowGroup){n_order, 1, 0};
                order[n_order++] = (int)(uint32_t)keys[j];
            }
        a = b;
    }
    free(keys);
    return n_groups;
}

/* the next work item to hand out (a counter shared by the threads) */
static inline long take(long *counter) { return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED); }

/* Row j's slice of a work item's scratch: its query (in the kernel's QT, cast by the caller) and acc,
 * [hg][width] floats each, then m and s [hg]; slices are row_floats apart. */
typedef struct {
    float *q, *acc, *m, *s;
    uint16_t *qt;
} RowState;
static inline RowState row_state(float *buf, size_t row_floats, int j, int max_hg, int width) {
    float *q = buf + row_floats * (size_t)j, *acc = q + (size_t)max_hg * width,
          *m = acc + (size_t)max_hg * width;
    /* then, 64-byte aligned, the query's AMX tiles where the scores run on AMX (amx_scores) */
    uint16_t *qt = (uint16_t *)(m + ((size_t)2 * max_hg + 15) / 16 * 16);
    return (RowState){q, acc, m, m + max_hg, qt};
}

/* 16 dot-product vectors (16 partial sums each) to one vector whose lane t is the sum of d[t]: a
 * transpose-and-add tree (45 shuffles and adds instead of 16 horizontal reductions of ~9 each). */
static inline __m512 hsum16x16(const __m512 d[16]) {
    __m512 a[8], b[4];
    /* 128-bit lane k: [d2i(4k)+d2i(4k+2), d2i+1(..), d2i(4k+1)+d2i(4k+3), d2i+1(..)] */
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                             _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
    /* lane k: tokens 4i .. 4i+3, each summed over lane k */
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Where the prefetches go, and how many of the next block's K rows the values pass fetches (below), per CPU
 * (cpu/build.py defines ASYNCENGINE_AMD_CPU on AMD CPUs; CPU_ZEN4: cpu_common.h):
 * - AMD Zen 5 (family 26, 48 KiB L1): L1, the first 8 rows. bfloat16, batch 64 x 256 keys out of cache, L2
 *   -> L1: one thread 16.5-16.8 -> 19.2-20.3 GB/s, two threads 26.6-29.4 -> 27.7-30.5 (three runs); with
 *   the pass-ahead prefetch, L1 still (64 x 256 / 16 x 1024 keys: 40.1 / 41.7 GB/s into L1, 38.9 / 40.8
 *   into L2; float32 level).
 * - AMD Zen 4 (family 25, 32 KiB L1): L2, every row. bfloat16 out of cache, 2 threads, `bench/
 *   paged_attention.py` alternated three times, first 8 rows into L1 -> every row into L2: 12 full heads at
 *   64 x 256 / 16 x 1024 keys 16.1-27.0 / 24.1-30.5 -> 27.4-32.1 / 26.6-29.4 GB/s; 14 heads over 2
 *   14.7-15.9 -> 19.2-20.3; head_dim 128, 8 over 2 21.7-22.0 -> 24.0-24.6 (every row into L1 was slower
 *   than 8, and 16 or 32 rows into L2 in between).
 * - Intel: L2, the first 8 rows (not measured with the pass-ahead prefetch; L2 had measured better). */
#if defined(ASYNCENGINE_AMD_CPU) && !CPU_ZEN4
#define PREFETCH_HINT _MM_HINT_T0
#else
#define PREFETCH_HINT _MM_HINT_T1
#endif
/* Of the next block's K only the first rows are prefetched (but on Zen 4, above): the jump to a block at a
 * random address is what the hardware prefetcher cannot guess, and from those rows on it streams the block
 * itself, which the scores pass reads row after row. Prefetching every row cost load slots for lines on
 * their way anyway (Zen 5, bfloat16 batch 64 x 256 / 16 x 1024 / 4 x 1024 keys in 64-token blocks, all rows
 * 29.7 / 31.8 / 29.1 GB/s, the first 16 31.7 / 33.2 / 30.8, the first 8 33.2 / 34.7 / 32.5). */
#ifndef NEXT_BLOCK_ROWS
#define NEXT_BLOCK_ROWS (CPU_ZEN4 ? MAX_BLOCK : 8)
#endif

/* Rows of the cache to prefetch a few lines at a time from inside a loop, so that the requests are spread
 * over that loop's arithmetic: `rows` rows of row_bytes, `stride` bytes apart, `per` lines a step. */
typedef struct {
    const char *p;
    long stride;
    int row_lines, rows, row, line, per;
} RowPrefetch;
static inline RowPrefetch row_prefetch(const void *p, long stride, long row_bytes, int rows, int steps) {
    const int row_lines = (int)((row_bytes + 63) / 64), lines = p ? rows * row_lines : 0;
    return (RowPrefetch){(const char *)p, stride, row_lines, p ? rows : 0, 0, 0,
                         steps > 0 ? (lines + steps - 1) / steps : lines};
}
static inline __attribute__((always_inline)) void row_prefetch_step(RowPrefetch *f) {
    for (int i = 0; i < f->per && f->row < f->rows; i++) {
        _mm_prefetch(f->p + f->row * f->stride + (long)f->line * 64, PREFETCH_HINT);
        if (++f->line == f->row_lines) { f->line = 0; f->row++; }
    }
}

/* ---- Decode scores with the keys in the lanes, for grouped-query attention (bfloat16 q and K) ----
 * The dots above take one key at a time: each head's dot is 16 partial sums, and the reduction tree costs
 * ~3 shuffles and adds a head and key on top of its vdpbf16ps (two at head_dim 64), the same for every
 * head of a KV head. Here 16 keys of a KV head are transposed once (keys_in_lanes8: lane i holds key i's
 * pair of dims) and each of the KV head's heads takes one vdpbf16ps per pair of dims with its query pair
 * broadcast: 16 keys' dots in one accumulator, no reduction. The transposes are shared by the group's
 * heads, so they pay where a KV head has heads enough for its head_dim (LANES_PAY). The sums run over the
 * pairs in order, even and odd apart (the dots above add 16 lanes of pairs in a tree): float32 roundings
 * differ, not the products, and a row's scores still do not depend on the batch. Scores come out [head]
 * [16 keys] and are transposed 16 heads at a time into the softmax's [hg / 16][sb][16] layout. */
#ifdef __AVX512BF16__
/* Where the keys in the lanes pay: the transposes cost D / (8 G) shuffles a key and head, the tree ~3
 * (one thread, keys in L2, ns a key and head, old -> new: head_dim 64 with 7 heads a KV head 2.28 -> 1.9,
 * 5 heads 2.5 -> 2.3, 4 heads level; head_dim 32 with 3-6 heads 2.4-2.7 -> 1.4-1.9; head_dim 96 with 8
 * heads 4.3 -> 2.8; head_dim 128 with 7 heads 3.5-3.6 -> 3.4, and 8% slower out of cache; with 4 heads
 * 8% slower). */
#ifndef LANES_PAY
#define LANES_PAY(group, head_dim) (5 * (head_dim) <= 64 * (group))
#endif
/* 16 keys' 8 pairs of dims (rows kh, kv_stride apart; rows from m on read as 0) -> t[j] lane i = key i's
 * pair j: rows i and i + 8 side by side in one vector, then an 8 x 8 dword transpose in each half (32
 * shuffles). 8 pairs, not 16, so that two accumulators a head fit in the registers beside them. */
static inline __attribute__((always_inline)) void keys_in_lanes8(const uint16_t *kh, long kv_stride, int m,
                                                                 __m512i t[8]) {
    __m512i r[8], a[8], b[8];
    for (int i = 0; i < 8; i++) {
        const __m256i lo = i < m ? _mm256_loadu_si256((const __m256i *)(kh + i * kv_stride)) : _mm256_setzero_si256();
        const __m256i hi =
            i + 8 < m ? _mm256_loadu_si256((const __m256i *)(kh + (i + 8) * kv_stride)) : _mm256_setzero_si256();
        r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* b[4h + c], 128-bit lane L: pair 4 (L & 1) + c of 4 rows from 4h (+8) */
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    const __m512i even = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), odd = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int c = 0; c < 4; c++) {
        t[c] = _mm512_permutex2var_epi64(b[c], even, b[4 + c]);
        t[4 + c] = _mm512_permutex2var_epi64(b[c], odd, b[4 + c]);
    }
}
/* dots of GS heads (queries q, qw bfloat16 apart) with m <= 16 keys (rows kh, kv_stride apart) -> tmp
 * [GS][16] (keys past m: 0). Two accumulators a head (even and odd pairs): one chain of vdpbf16ps a head
 * left a group of 4-8 heads bound by the instruction's latency. */
static inline __attribute__((always_inline)) void lane_dots_gs(int GS, const uint16_t *q, int qw, const uint16_t *kh,
                                                               int m, long kv_stride, int head_dim, float *tmp,
                                                               RowPrefetch *kp, RowPrefetch *vp) {
    __m512 acc[2][8];
    for (int g = 0; g < GS; g++) acc[0][g] = acc[1][g] = _mm512_setzero_ps();
    for (int d0 = 0; d0 < head_dim; d0 += 16) {
        __m512i t[8];
        row_prefetch_step(kp);
        row_prefetch_step(vp);
        keys_in_lanes8(kh + d0, kv_stride, m, t);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
#pragma GCC unroll 8
            for (int g = 0; g < GS; g++) {
                int32_t pair;
                memcpy(&pair, q + (long)g * qw + d0 + 2 * j, sizeof pair);
                acc[j & 1][g] = _mm512_dpbf16_ps(acc[j & 1][g], (__m512bh)t[j], (__m512bh)_mm512_set1_epi32(pair));
            }
    }
    for (int g = 0; g < GS; g++) _mm512_storeu_ps(tmp + g * 16, _mm512_add_ps(acc[0][g], acc[1][g]));
}
static inline __attribute__((always_inline)) void lane_dots_at(const uint16_t *q, float *scores, const uint16_t *kb,
                                                               const uint16_t *v_here, int n, int nkv, int group,
                                                               int head_dim, int qw, int sb, long kv_stride,
                                                               float scale) {
    const int hg = nkv * group, hg16 = (hg + 15) / 16 * 16;
    float tmp[hg16 * 16];
    const __m512 sc = _mm512_set1_ps(scale);
    for (int x = hg; x < hg16; x++) _mm512_storeu_ps(tmp + x * 16, _mm512_setzero_ps());
    const long row_bytes = (long)nkv * head_dim * 2, stride = kv_stride * 2;
    /* the prefetch steps of a 16-key chunk: one per KV head, slab of 16 dims and run of up to 8 heads */
    const int steps = nkv * (head_dim / 16) * ((group + 7) / 8);
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int m = n - t0 < 16 ? n - t0 : 16, next = n - t0 - 16 < 16 ? n - t0 - 16 : 16;
        /* Spread over the chunk's work: the next 16 keys' K rows (the transposes read 16 rows a column at a
         * time, a walk the hardware prefetcher does not follow as it does a row-by-row one) and these keys'
         * V rows for the values pass. The values pass before fetched the first 8 rows of the block. */
        RowPrefetch kp = row_prefetch(next > 0 ? kb + (t0 + 16) * kv_stride : NULL, stride, row_bytes, next, steps);
        RowPrefetch vp = row_prefetch(v_here ? v_here + t0 * kv_stride : NULL, stride, row_bytes, m, steps);
        if (t0 == 0) /* rows 8-15 of the block's first chunk */
            for (int t = 8; t < m; t++)
                for (long b = 0; b < row_bytes; b += 64) _mm_prefetch((const char *)(kb + t * kv_stride) + b, PREFETCH_HINT);
        for (int h = 0; h < nkv; h++)
            for (int g0 = 0; g0 < group; g0 += 8) {
                const int x = h * group + g0, gs = group - g0 < 8 ? group - g0 : 8;
                const uint16_t *qh = q + (long)x * qw, *kh = kb + t0 * kv_stride + (long)h * head_dim;
                float *const o = tmp + x * 16;
                switch (gs) {
                case 8: lane_dots_gs(8, qh, qw, kh, m, kv_stride, head_dim, o, &kp, &vp); break;
                case 7: lane_dots_gs(7, qh, qw, kh, m, kv_stride, head_dim, o, &kp, &vp); break;
                case 6: lane_dots_gs(6, qh, qw, kh, m, kv_stride, head_dim, o, &kp, &vp); break;
                case 5: lane_dots_gs(5, qh, qw, kh, m, kv_stride, head_dim, o, &kp, &vp); break;
                case 4: lane_dots_gs(4, qh, qw, kh, m, kv_stride, head_dim, o, &kp, &vp); break;
                case 3: lane_dots_gs(3, qh, qw, kh, m, kv_stride, head_dim, o, &kp, &vp); break;
                case 2: lane_dots_gs(2, qh, qw, kh, m, kv_stride, head_dim, o, &kp, &vp); break;
                default: lane_dots_gs(1, qh, qw, kh, m, kv_stride, head_dim, o, &kp, &vp); break;
                }
            }
        for (int c0 = 0; c0 < hg; c0 += 16) { /* [16 heads][16 keys] -> [16 keys][16 heads], scaled */
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(tmp + (c0 + i) * 16);
            transpose16(r); /* cpu_common.h */
            for (int t = 0; t < m; t++)
                _mm512_store_ps(scores + c0 * sb + (t0 + t) * 16, _mm512_mul_ps(_mm512_castsi512_ps(r[t]), sc));
        }
    }
}
/* Takes the scores where it pays (LANES_PAY, head_dim a multiple of 32); returns whether it did. */
static inline int lane_dots(const void *q, float *scores, const void *kb, const void *v_here, int n, int nkv,
                            int group, int head_dim, int qw, int sb, long kv_stride, float scale) {
    if (!LANES_PAY(group, head_dim) || head_dim % 32) return 0;
    const uint16_t *qb = (const uint16_t *)q, *k = (const uint16_t *)kb, *v = (const uint16_t *)v_here;
    if (head_dim == 64) /* the usual one with heads enough: its slab loop unrolled */
        lane_dots_at(qb, scores, k, v, n, nkv, group, 64, qw, sb, kv_stride, scale);
    else
        lane_dots_at(qb, scores, k, v, n, nkv, group, head_dim, qw, sb, kv_stride, scale);
    return 1;
}
#endif
/* the kernels whose q or K is not bfloat16 */
static inline int no_lane_dots(const void *q, float *scores, const void *kb, const void *v_here, int n, int nkv,
                               int group, int head_dim, int qw, int sb, long kv_stride, float scale) {
    (void)q, (void)scores, (void)kb, (void)v_here, (void)n, (void)nkv, (void)group, (void)head_dim, (void)qw;
    (void)sb, (void)kv_stride, (void)scale;
    return 0;
}

/* ---- p.v over key pairs (bfloat16 caches with AVX512-BF16, on AMD Zen 4) ----
 * The values pass multiplies each V element by a head's probability in float32: a widening and an FMA per
 * 16 dims, key and head. With PAIRED_VALUES the probabilities are rounded to bfloat16 (as torch's flash
 * kernel and this project's prompt kernels do for bfloat16 inputs; the row sums and acc stay float32) and
 * stored as pairs, keys t and t + 1 in one 32-bit lane; two V rows are interleaved with one unpack each
 * per 32 dims, shared by the KV head's heads, and one vdpbf16ps per 16 dims adds both keys' products: half
 * the multiply-adds and no widenings. An odd last key pairs with a zero probability and a zero row (never
 * the memory past the block's keys). The unpack leaves a 32-dim chunk's dims in the order acc_unpack
 * (below) undoes when the output is stored. It is also closer to HF's bfloat16 run: torch's SDPA called as
 * HF calls it (4-D, its CPU flash kernel) rounds P too; 16-row batches of 1-300 keys, four head layouts,
 * float32 P -> pairs: output elements equal to SDPA's 68-75% -> 76-85%, mean |difference| 2.1-2.4e-4 ->
 * 1.1-1.6e-4; against float64 the kernel's mean error 3.2-4.4e-4 -> 3.9-5.1e-4, SDPA's own 4.1-5.2e-4.
 * Speed on Zen 4 (2 threads, bfloat16, 2026-12-07), float32 P -> pairs: one thread with the K/V in L2, ns
 * a key and head, 14 over 2 heads 3.53 -> 3.10, 16 over 4 4.37 -> 3.40, head_dim 128 8 over 2 8.55 ->
 * 6.72, 16 over 8 8.20 -> 7.03, 12 full heads level (6.08 / 6.20); out of cache (bench/paged_attention.py,
 * four passes) 14 over 2 heads +10-15%, 12 full heads level; a decode step level within the VM's noise. On
 * AMD Zen 5 an earlier form of it (one unpack per head, before the runs of heads) was slower for grouped
 * heads in cache (43.3 -> 33.5 GB/s), so elsewhere the float32 pass stays until measured again (build with
 * a CC wrapper adding -DPAIRED_VALUES=1 and its own ASYNCENGINE_CACHE_DIR, then bench/paged_attention.py
 * side by side). */
#ifndef PAIRED_VALUES /* -DPAIRED_VALUES=0 / 1 to measure the two side by side */
#define PAIRED_VALUES CPU_ZEN4
#endif
#ifdef __AVX512BF16__
static inline __m512 pack_pairs(__m512 p0, __m512 p1) { return _mm512_castsi512_ps(bf16_pairs(p0, p1)); }
static inline __m512 dot_pairs(__m512 acc, __m512 p, __m512 v) {
    return _mm512_dpbf16_ps(acc, (__m512bh)p, (__m512bh)v);
}
#else /* the kernels that take them are not built */
static inline __m512 pack_pairs(__m512 p0, __m512 p1) { (void)p1; return p0; }
static inline __m512 dot_pairs(__m512 acc, __m512 p, __m512 v) { (void)p, (void)v; return acc; }
#endif
/* V rows t (at p) and t + 1 (stride elements further; zero if !two), 32 bfloat16 dims from p (zero past
 * left), as key pairs: lo holds dims 8L .. 8L + 3 of each 128-bit lane L, hi dims 8L + 4 .. 8L + 7. */
static inline void vpair32_bf16(const void *p, long stride, int two, int left, __m512 *lo, __m512 *hi) {
    const uint16_t *a = (const uint16_t *)p;
    const __mmask32 mk = mask32_upto(left);
    const __m512i x = _mm512_maskz_loadu_epi16(mk, a), y = _mm512_maskz_loadu_epi16(two ? mk : 0, a + stride);
    *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(x, y));
    *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(x, y));
}

/* One row's heads over n keys of one cache block, in two halves: scores = q.k and the online softmax over
 * them (rescaling acc); then acc += p.v (NAME##_values). Scores are laid out [hg / 16][sb][16]: a key's
 * dots with 16 heads are reduced together (hsum16x16) into one vector, and the softmax then works on 16
 * heads a vector, one key at a time. kb/vb: the block's first key at the run's first KV head.
 * Prefetch, one pass ahead: the scores pass reads K row after row (a stream the hardware prefetcher
 * follows) while it fetches this block's V rows, one row per key (v_here, or NULL where they are in cache
 * already); the values pass reads V a 32-dim column at a time, all rows per column, from L1/L2 then, while
 * it fetches the next block's first K rows (k_next, or NULL), a few lines per step. Before, each half
 * fetched the next block's first rows (K in the scores half, V in the values half), and the values pass's
 * column walk met V in DRAM: old -> new, 64-token blocks, 2 threads (AMD EPYC Zen 5, tables scattered at
 * random, 12 layers cycled), bfloat16 64 x 256 / 16 x 1024 / 4 x 1024 / 64 x 64 keys 35.4 / 36.2 / 39.9 /
 * 39.2 -> 42.8 / 43.1 / 44.7 / 44.7 GB/s; 16 heads over 4 KV heads 24.1 / 23.6 -> 32.7 / 32.2; 8 heads of
 * 128 over 2 KV heads 23.3 / 24.3 -> 31.0 / 32.2; 16-token blocks 28.6 / 29.5 -> 33.0 / 33.8; float32
 * 39.3 / 40.2 / 41.0 -> 41.3 / 41.5 / 43.2. */
#define DEFINE_AVX512_BLOCK(NAME, QT, QDOT, KT, VLOAD32, LANE_DOTS, PAIRS)                                               \
/* scores = q.k on the vector units: called with a constant head_dim for the usual 64 and 128, so that \
 * the dots and the loop over 16 heads unroll into straight-line code. Generic, each head cost a        \
 * division and a two-trip inner loop with its branches and masks: with 12 heads of 64 bfloat16 K/V in  \
 * L2, one thread, 2 rows of 256 keys: 59 -> 50.5 us; from DRAM (bench/paged_attention.py, 2 threads)   \
 * 20.1-20.9 -> 21.8-23.1 GB/s, float32 22.9 -> 25-26. The same products in the same order.        */ \
static inline __attribute__((always_inline)) void NAME##_dots(const QT *qf, float *scores, const KT *kb, \
                                 const KT *v_here, int n, int nkv, int group, int head_dim, int qw,     \
                                 int sb, long kv_stride, float scale) {                                 \
    const int hg = nkv * group;                                                                         \
    long koff[hg]; /* head x's offset in a key row */                                                   \
    for (int x = 0; x < hg; x++) koff[x] = (long)(x / group) * head_dim;                                \
    for (int t = 0; t < n; t++) {                                                                       \
        const KT *kt = kb + t * kv_stride;                                                              \
        if (v_here) /* this block's V row t, for the values pass */                                     \
            for (long b = 0; b < (long)nkv * head_dim * (long)sizeof(KT); b += 64)                      \
                _mm_prefetch((const char *)(v_here + t * kv_stride) + b, PREFETCH_HINT);                \
        for (int c0 = 0; c0 < hg; c0 += 16) { /* 16 heads' dots with key t, reduced together */        \
            __m512 d[16];                                                                               \
            _Pragma("GCC unroll 16")                                                                    \
            for (int x = 0; x < 16; x++)                                                                \
                d[x] = c0 + x < hg ? QDOT(qf + (c0 + x) * qw, kt + koff[c0 + x], head_dim)                \
                                   : _mm512_setzero_ps();                                               \
            _mm512_store_ps(scores + c0 * sb + t * 16, _mm512_mul_ps(hsum16x16(d), _mm512_set1_ps(scale))); \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
static inline void NAME##_scores(const QT *qf, float *acc, float *m, float *s, float *scores,             \
                                 const KT *kb, const KT *v_here, const uint16_t *qt, int n, int nkv,      \
                                 int group, int head_dim, int width, int qw, int sb, long kv_stride,      \
                                 float scale) {                                                         \
    const int hg = nkv * group;                                                                         \
    if (qt) /* on AMX tiles (amx_scores): the heads of a KV head share its key rows */                   \
        amx_scores(qt, (const uint16_t *)kb, (const char *)v_here, scores, n, hg, group, head_dim, sb,   \
                   kv_stride, (long)nkv * head_dim * (long)sizeof(KT), scale);                          \
    else if (LANE_DOTS(qf, scores, kb, v_here, n, nkv, group, head_dim, qw, sb, kv_stride, scale))      \
        ; /* grouped heads with the keys in the lanes (lane_dots) */                                    \
    else if (head_dim == 64)                                                                            \
        NAME##_dots(qf, scores, kb, v_here, n, nkv, group, 64, qw, sb, kv_stride, scale);                \
    else if (head_dim == 128)                                                                           \
        NAME##_dots(qf, scores, kb, v_here, n, nkv, group, 128, qw, sb, kv_stride, scale);               \
    else                                                                                                \
        NAME##_dots(qf, scores, kb, v_here, n, nkv, group, head_dim, qw, sb, kv_stride, scale);          \
    for (int c0 = 0; c0 < hg; c0 += 16) { /* online softmax over this block, 16 heads a vector */       \
        const __mmask16 hm = mask_upto(hg - c0);                                                        \
        float *sc = scores + c0 * sb;                                                                   \
        __m512 mx = _mm512_set1_ps(-INFINITY);                                                          \
        for (int t = 0; t < n; t++) mx = _mm512_max_ps(mx, _mm512_load_ps(sc + t * 16));                \
        const __m512 mold = _mm512_maskz_loadu_ps(hm, m + c0);                                          \
        const __mmask16 grow = _mm512_mask_cmp_ps_mask(hm, mx, mold, _CMP_GT_OQ);                       \
        const __m512 mnew = _mm512_mask_mov_ps(mold, grow, mx);                                         \
        __m512 sv = _mm512_maskz_loadu_ps(hm, s + c0);                                                  \
        if (grow) { /* rescale what was accumulated under the old maximum */                            \
            __m512 cv = exp512(_mm512_sub_ps(mold, mnew));                                              \
            cv = _mm512_mask_mov_ps(cv, _mm512_cmp_ps_mask(mold, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), _mm512_setzero_ps()); \
            sv = _mm512_mask_mul_ps(sv, grow, sv, cv);                                                  \
            float cs[16];                                                                               \
            _mm512_storeu_ps(cs, cv);                                                                   \
            for (__mmask16 g = grow; g; g &= (__mmask16)(g - 1)) {                                      \
                const int x = c0 + __builtin_ctz(g);                                                    \
                const __m512 c = _mm512_set1_ps(cs[x - c0]);                                            \
                for (int j = 0; j < width; j += 16)                                                     \
                    _mm512_store_ps(acc + x * width + j, _mm512_mul_ps(_mm512_load_ps(acc + x * width + j), c)); \
            }                                                                                           \
            _mm512_mask_storeu_ps(m + c0, hm, mnew);                                                    \
        }                                                                                               \
        __m512 sum = _mm512_setzero_ps();                                                               \
        if (PAIRS) /* keys t, t + 1 as a bfloat16 pair in slot t / 2 (read before it is written) */      \
            for (int t = 0; t < n; t += 2) {                                                            \
                const __m512 p0 = exp512(_mm512_sub_ps(_mm512_load_ps(sc + t * 16), mnew));             \
                const __m512 p1 = t + 1 < n ? exp512(_mm512_sub_ps(_mm512_load_ps(sc + t * 16 + 16), mnew)) \
                                            : _mm512_setzero_ps();                                      \
                sum = _mm512_add_ps(_mm512_add_ps(sum, p0), p1);                                        \
                _mm512_store_ps(sc + t * 8, pack_pairs(p0, p1));                                        \
            }                                                                                           \
        else                                                                                            \
            for (int t = 0; t < n; t++) {                                                               \
                const __m512 p = exp512(_mm512_sub_ps(_mm512_load_ps(sc + t * 16), mnew));              \
                _mm512_store_ps(sc + t * 16, p);                                                        \
                sum = _mm512_add_ps(sum, p);                                                            \
            }                                                                                           \
        _mm512_mask_storeu_ps(s + c0, hm, _mm512_add_ps(sv, sum));                                      \
    }                                                                                                   \
}                                                                                                       \
/* acc += p.v for R = 1, 2 or 4 rows and the heads x0 .. x0 + NK x GS - 1: NK KV heads side by side (V rows \
 * at vh, the next KV head head_dim further), GS heads each, over the same block, 32 dims at a time: each V \
 * chunk is loaded and widened once for all of its heads (VLOAD32: two float32 vectors, lo and hi, in acc's \
 * layout; ACC_INDEX maps a dim to its acc slot), so that the heads of a grouped-query KV head share its    \
 * widening, and R x NK x GS <= 8 (16 accumulators) keep that many independent FMA chains in flight. Every  \
 * head of every row adds the same products in the same order whatever R, NK and GS are. pf: prefetches  \
 * issued a step per key and chunk. With PAIRS the probabilities are bfloat16 key pairs (p.v over key    \
 * pairs, above) and a step takes keys t and t + 1 with one vdpbf16ps per 16 dims. */                  \
static inline __attribute__((always_inline)) void NAME##_values_gs(int R, int NK, int GS, int x0, float *const *acc, \
                                 const float *const *scores, const KT *vh, int n, int head_dim, int width, \
                                 int sb, long kv_stride, RowPrefetch *pf) {                             \
    for (int j = 0; j < width; j += 32) {                                                               \
        __m512 lo[8], hi[8]; /* [(r * NK + k) * GS + g] */                                              \
        for (int r = 0; r < R; r++)                                                                     \
            for (int k = 0; k < NK; k++)                                                                \
                for (int g = 0; g < GS; g++) {                                                          \
                    const long o = (long)(x0 + k * GS + g) * width + j;                                 \
                    lo[(r * NK + k) * GS + g] = _mm512_load_ps(acc[r] + o);                             \
                    hi[(r * NK + k) * GS + g] = _mm512_load_ps(acc[r] + o + 16);                        \
                }                                                                                       \
        /* PAIRS: two keys a step, their probabilities' pair (slot t / 2) against two interleaved V rows */ \
        for (int t = 0; t < n; t += PAIRS ? 2 : 1) {                                                    \
            row_prefetch_step(pf);                                                                      \
            if (PAIRS) row_prefetch_step(pf);                                                           \
            for (int k = 0; k < NK; k++) {                                                              \
                const KT *vt = vh + t * kv_stride + (long)k * head_dim + j;                             \
                __m512 vl, vh2;                                                                         \
                if (PAIRS)                                                                              \
                    vpair32_bf16(vt, kv_stride, t + 1 < n, head_dim - j, &vl, &vh2);                    \
                else                                                                                    \
                    VLOAD32(vt, head_dim - j, &vl, &vh2);                                               \
                for (int r = 0; r < R; r++)                                                             \
                    for (int g = 0; g < GS; g++) {                                                      \
                        const int x = x0 + k * GS + g, a = (r * NK + k) * GS + g;                       \
                        const __m512 p = _mm512_set1_ps(scores[r][(x >> 4) * sb * 16 + t * (PAIRS ? 8 : 16) + (x & 15)]); \
                        lo[a] = PAIRS ? dot_pairs(lo[a], p, vl) : _mm512_fmadd_ps(p, vl, lo[a]);        \
                        hi[a] = PAIRS ? dot_pairs(hi[a], p, vh2) : _mm512_fmadd_ps(p, vh2, hi[a]);      \
                    }                                                                                   \
            }                                                                                           \
        }                                                                                               \
        for (int r = 0; r < R; r++)                                                                     \
            for (int k = 0; k < NK; k++)                                                                \
                for (int g = 0; g < GS; g++) {                                                          \
                    const long o = (long)(x0 + k * GS + g) * width + j;                                 \
                    _mm512_store_ps(acc[r] + o, lo[(r * NK + k) * GS + g]);                             \
                    _mm512_store_ps(acc[r] + o + 16, hi[(r * NK + k) * GS + g]);                        \
                }                                                                                       \
    }                                                                                                   \
}                                                                                                       \
/* acc += p.v for R = 1, 2 or 4 rows over the same block, the heads of each KV head in runs of up to 8 / R \
 * (measured with 16 heads over 4 KV heads: ~3x the arithmetic per byte of K/V of 12 full heads, and the \
 * widening of V repeated per head had made the kernel compute-bound). A KV head of 3, 5, 6 or 7 heads is \
 * one run: in runs of 4 + 2 + 1 the one- and two-head runs were bound by the FMA chains' latency (two or \
 * four chains a key). One thread, keys in L2, ns per key and head: groups of 7 2.65 -> 2.12, of 3 3.49 ->\
 * 2.48, of 5 2.70 -> 2.32, of 6 2.51 -> 2.34; from DRAM (bench/paged_attention.py, 2 threads, batch 64 x \
 * 256 keys) 14 heads over 2 0.43 -> 0.34 ms a layer, 24 over 8 1.16 -> 1.00. k_next: the next block, whose\
 * first NEXT_BLOCK_ROWS K rows are fetched over the pass (NULL: none). */                              \
static inline __attribute__((always_inline)) void NAME##_values_at(int R, float *const *acc, const float *const *scores, const KT *vb, int n, \
                                 int nkv, int group, int head_dim, int width, int sb, long kv_stride,     \
                                 const KT *k_next) {                                                    \
    const int hg = nkv * group, cap = 8 / R;                                                            \
    /* steps: the fewest the pass takes (runs of at most cap heads), so the rows are all asked for */   \
    const int steps = n * ((width + 31) / 32) * ((hg + cap - 1) / cap);                                 \
    RowPrefetch pf = row_prefetch(k_next, kv_stride * (long)sizeof(KT), (long)nkv * head_dim * (long)sizeof(KT),\
                                  NEXT_BLOCK_ROWS < sb ? NEXT_BLOCK_ROWS : sb, steps);                  \
    for (int x0 = 0, gs, nk; x0 < hg; x0 += nk * gs) {                                                  \
        const int kv = x0 / group, left = (kv + 1) * group - x0; /* this KV head's heads from x0 */     \
        /* a whole KV head of up to cap heads in one run (3, 5, 6, 7 too: runs of 4 + 2 + 1 left one-   \
         * and two-head runs latency-bound), else runs of 8, 4, 2, 1 */                                 \
        gs = left < cap ? left : cap;                                                                   \
        const int pow2 = (gs & (gs - 1)) == 0;                                                          \
        if (gs != group) gs = gs >= 8 ? 8 : gs >= 4 ? 4 : gs >= 2 ? 2 : 1;                             \
        /* whole small KV heads side by side, so that R x NK x GS accumulator pairs stay in flight */   \
        const int fit = gs == group && (pow2 || gs == 3) ? (nkv - kv < cap / gs ? nkv - kv : cap / gs) : 1; \
        nk = fit >= 8 ? 8 : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;                                            \
        const KT *vh = vb + kv * head_dim;                                                              \
        if (cap >= 8 && gs == 7)                                                                        \
            NAME##_values_gs(R, 1, 7, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 8 && gs == 6)                                                                   \
            NAME##_values_gs(R, 1, 6, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 8 && gs == 5)                                                                   \
            NAME##_values_gs(R, 1, 5, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 8 && gs == 3 && nk == 2)                                                        \
            NAME##_values_gs(R, 2, 3, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 4 && gs == 3)                                                                   \
            NAME##_values_gs(R, 1, 3, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 8 && gs == 8)                                                                   \
            NAME##_values_gs(R, 1, 8, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 8 && gs == 4 && nk == 2)                                                        \
            NAME##_values_gs(R, 2, 4, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 4 && gs == 4)                                                                   \
            NAME##_values_gs(R, 1, 4, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 8 && gs == 2 && nk == 4)                                                        \
            NAME##_values_gs(R, 4, 2, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 4 && gs == 2 && nk == 2)                                                        \
            NAME##_values_gs(R, 2, 2, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 2 && gs == 2)                                                                   \
            NAME##_values_gs(R, 1, 2, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 8 && nk == 8)                                                                   \
            NAME##_values_gs(R, 8, 1, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 4 && nk == 4)                                                                   \
            NAME##_values_gs(R, 4, 1, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else if (cap >= 2 && nk == 2)                                                                   \
            NAME##_values_gs(R, 2, 1, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
        else                                                                                            \
            NAME##_values_gs(R, 1, 1, x0, acc, scores, vh, n, head_dim, width, sb, kv_stride, &pf);         \
    }                                                                                                   \
}                                                                                                       \
/* acc += p.v (NAME##_values_at) with a constant head_dim for the usual 64 and 128, as the dots: the V loads' \
 * masks and the loop over 32-dim chunks then fold away. The same products in the same order. */       \
static inline __attribute__((always_inline)) void NAME##_values(int R, float *const *acc, const float *const *scores, const KT *vb, int n, \
                                 int nkv, int group, int head_dim, int width, int sb, long kv_stride,     \
                                 const KT *k_next) {                                                    \
    if (head_dim == 64)                                                                                 \
        NAME##_values_at(R, acc, scores, vb, n, nkv, group, 64, 64, sb, kv_stride, k_next);              \
    else if (head_dim == 128)                                                                           \
        NAME##_values_at(R, acc, scores, vb, n, nkv, group, 128, 128, sb, kv_stride, k_next);            \
    else                                                                                                \
        NAME##_values_at(R, acc, scores, vb, n, nkv, group, head_dim, width, sb, kv_stride, k_next);     \
}

/* Long rows are split at fixed key positions, every SEG_KEYS keys (rounded to whole blocks): each
 * segment's online-softmax state (m, s, acc) is kept as a partial and the partials are merged at the end
 * (flash-decoding). While whole rows are too few to keep the threads busy, a lone row's segments are
 * separate work items, so one long sequence keeps both threads streaming whole cache blocks instead of
 * a few heads each. Where a row is cut depends only on its own keys, never on the batch or the threads,
 * and rows walked whole (and prefix-sharing groups) flush at the same places: a row's result is the
 * same in any batch. Measured per bf16 layer (12 heads of 64, 2 threads): batch 1 at 4096 keys 1.08 ->
 * 0.71 ms, at 8192 keys 2.53 -> 1.21 ms, batch 4 at 4096 keys 3.62 -> 2.55 ms. 1024, not 256 or 512:
 * the cut rows of a big batch pay for their flushes and merges (~2-3% of the layer at 700 keys and
 * 512-key segments) and gain nothing there, and the bench's contexts (up to 768) stay uncut. */
/* Head runs are not cut below one vector of heads (16) to balance work, only to give every thread an
 * item: the scores and the online softmax run 16 heads a vector, so an item of one head used a sixteenth
 * of each. Measured per bf16 layer (12 heads of 64, 2 threads, keys in cache): batch 1 at 200-400 keys
 * 57 -> 23 us (one-head items before, two six-head items now), batch 2-3 at 100-600 keys 91 -> 53 and
 * 62 -> 43 us, batch 16 at 16-1024 keys 809 -> 753-785 us, batch 64 unchanged (whole rows already).
 * A group of rows sharing a prefix is still cut below that (down to one head) while it would hold over a
 * quarter of a thread's share: left whole, one thread walked 50 rows of a shared prefix while the other
 * idled (batch 64 with 50 sharers: 1.4 -> 2.5 ms a layer, the shared-prefix sweep cell 1.09 -> 0.73x). */
#define MIN_RUN_HEADS 16
#ifndef SEG_KEYS
#define SEG_KEYS 1024
#endif
typedef struct { int group, seg; } WorkItem; /* seg < 0: the group's rows whole */

/* A row's state for heads h0 .. h0 + hg - 1 -> its partial slot dst [num_heads][width + 2] (m, s, acc),
 * then reset for the next segment. */
static inline void flush_state(float *dst, int h0, int hg, int width, float *acc, float *m, float *s) {
    for (int x = 0; x < hg; x++) {
        float *d = dst + (size_t)(h0 + x) * (width + 2);
        d[0] = m[x];
        d[1] = s[x];
        memcpy(d + 2, acc + (size_t)x * width, sizeof(float) * (size_t)width);
        memset(acc + (size_t)x * width, 0, sizeof(float) * (size_t)width);
        m[x] = -INFINITY;
        s[x] = 0.f;
    }
}

/* One work item = one group of rows (or one segment of a lone row) and a run of `per` KV heads: all the
 * heads while there are items enough to keep the threads busy (the keys of a cache block are then one
 * contiguous stream), fewer while the largest item would hold more than a quarter of a thread's share
 * of the work. */
#define DEFINE_AVX512_KERNEL(NAME, T, KT, QT, QLOAD, QDOT, VLOAD32, ACC_INDEX, STORE, AMX, LANE_DOTS, PAIRS) \
DEFINE_AVX512_BLOCK(NAME, QT, QDOT, KT, VLOAD32, LANE_DOTS, PAIRS)                                                          \
int NAME(const T *q, const KT *k_cache, const KT *v_cache, T *out, const int32_t *block_tables,             \
         const int32_t *query_start, const int32_t *seq_lens, const uint8_t *skip, int num_seqs,          \
         int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,      \
         int window, int num_threads) {                                                                 \
    const int group = num_heads / num_kv_heads;                                                         \
    if (head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || group > MAX_GROUP) return -1;              \
    const int width = (head_dim + 31) / 32 * 32, sb = (block_size + 15) / 16 * 16, pw = width + 2;      \
    const int qw = width * (int)(sizeof(float) / sizeof(QT)); /* q [hg][qw] as QDOT takes it, in width floats */ \
    const int seg_keys = (SEG_KEYS + block_size - 1) / block_size * block_size;                         \
    const int num_rows = query_start[num_seqs];                                                         \
    if (num_rows <= 0) return 0;                                                                        \
    /* per row: sequence, keys, first key, first segment, number of segments, first partial slot */     \
    int *ints = (int *)malloc(sizeof(int) * 8 * (size_t)num_rows);                                     \
    RowGroup *groups = (RowGroup *)malloc(sizeof(RowGroup) * (size_t)num_rows);                         \
    if (!ints || !groups) { free(ints); free(groups); return -2; }                                      \
    int *row_seq = ints, *row_keys = ints + num_rows, *order = ints + 2 * num_rows;                     \
    int *first_key = ints + 3 * num_rows, *first_seg = ints + 4 * num_rows, *nseg = ints + 5 * num_rows; \
    int *part_off = ints + 6 * num_rows, *split_rows = ints + 7 * num_rows;                             \
    int active = 0; /* rows the kernel computes */                                                      \
    for (int i = 0; i < num_seqs; i++) if (!(skip && skip[i])) active += query_start[i + 1] - query_start[i]; \
    const long share = (long)active * num_kv_heads / (4L * num_threads); /* row-heads: a quarter of a thread's */ \
    /* with a sliding window rows read different leading blocks: no groups */                          \
    const int max_group = window > 0 ? 1 : share / num_kv_heads > 2 ? (int)(share / num_kv_heads) : 2;  \
    const int num_groups = group_rows(block_tables, query_start, seq_lens, skip, num_seqs, max_blocks,  \
                                      block_size, max_group, row_seq, row_keys, order, groups);         \
    if (num_groups < 0) { free(ints); free(groups); return -2; }                                        \
    int num_parts = 0, num_split = 0, num_items = 0;                                                    \
    for (int g = 0; g < num_groups; g++)                                                                \
        for (int j = 0; j < groups[g].count; j++) {                                                     \
            const int row = order[groups[g].first + j], n_keys = row_keys[row];                         \
            first_key[row] = window > 0 && n_keys > window ? n_keys - window : 0;                       \
            first_seg[row] = first_key[row] / seg_keys;                                                 \
            nseg[row] = n_keys > 0 ? (n_keys - 1) / seg_keys - first_seg[row] + 1 : 1;                  \
            part_off[row] = num_parts;                                                                  \
            if (nseg[row] > 1) { num_parts += nseg[row]; split_rows[num_split++] = row; }               \
        }                                                                                               \
    /* a lone row's segments become work items of their own only while whole rows are too few to keep \
     * the threads busy; otherwise one item walks them in turn (same flushes, same bits, and its       \
     * prefetch runs on across the segment boundaries) */                                              \
    const int split_items = num_groups < 4 * num_threads;                                               \
    for (int g = 0; g < num_groups; g++) {                                                              \
        const int row = order[groups[g].first];                                                         \
        num_items += split_items && groups[g].count == 1 && groups[g].shared == 0 ? nseg[row] : 1;      \
    }                                                                                                   \
    WorkItem *items = (WorkItem *)malloc(sizeof(WorkItem) * (size_t)(num_items > 0 ? num_items : 1));   \
    float *parts = num_parts ? (float *)malloc(sizeof(float) * (size_t)num_parts * num_heads * pw) : NULL; \
    if (!items || (num_parts && !parts)) { free(ints); free(groups); free(items); free(parts); return -2; } \
    for (int g = 0, k = 0; g < num_groups; g++) {                                                       \
        const int row = order[groups[g].first];                                                         \
        if (split_items && groups[g].count == 1 && groups[g].shared == 0 && nseg[row] > 1)              \
            for (int sg = 0; sg < nseg[row]; sg++) items[k++] = (WorkItem){g, first_seg[row] + sg};     \
        else items[k++] = (WorkItem){g, -1};                                                            \
    }                                                                                                   \
    int biggest = 1; /* rows of the largest group (a lone row's segment counts as one row) */           \
    for (int g = 0; g < num_groups; g++) if (groups[g].count > biggest) biggest = groups[g].count;       \
    /* row-heads, a segment of a split lone row counting as a row: a quarter of a thread's share */     \
    const long units = (long)active + (num_items - num_groups), item_share = units * num_kv_heads / (4L * num_threads); \
    /* halve the head runs while the threads outnumber the items, while a group of rows (a shared      \
     * prefix) would hold over a quarter of a thread's share, or, down to MIN_RUN_HEADS heads a run,     \
     * while there are fewer items than four a thread */                                                \
    int per = num_kv_heads;                                                                             \
    for (;;) {                                                                                          \
        const long n_it = (long)num_items * ((num_kv_heads + per - 1) / per);                           \
        const int too_big = biggest > 1 && (long)biggest * per > item_share;                           \
        const int too_few = n_it < 4L * num_threads && per * group > MIN_RUN_HEADS;                     \
        if (per == 1 || (n_it >= num_threads && !too_big && !too_few)) break;                           \
        per = (per + 1) / 2;                                                                            \
    }                                                                                                   \
    const int num_chunks = (num_kv_heads + per - 1) / per;                                              \
    const long total = (long)num_items * num_chunks, kv_stride = (long)num_kv_heads * head_dim;         \
    const int max_hg = per * group, max_hg16 = (max_hg + 15) / 16 * 16;                                  \
    /* one row's q, acc [hg][width]; m, s [hg]; rounded to 16 floats so every row's q and acc stay 64-byte aligned */ \
    /* the scores on AMX tiles: a bfloat16 cache (AMX), 3+ heads a KV head, whole tiles of keys */      \
    const int amx = AMX && amx_scores_on && group >= MIN_AMX_GROUP && head_dim % 32 == 0 && block_size % 16 == 0    \
                    && amx_ready();                                                                     \
    const size_t row_floats = (size_t)max_hg * 2 * width + ((size_t)2 * max_hg + 15) / 16 * 16          \
                              + (amx ? (size_t)qt_tiles(max_hg, group, head_dim) * 256 : 0);            \
    int failed = 0;                                                                                     \
    long counter = 0; /* the next work item to hand out */                                              \
    _Pragma("omp parallel num_threads(num_threads)")                                                    \
    {                                                                                                   \
        /* per thread: the rows' state for the biggest group, then scores [4][hg][sb] */                 \
        const size_t floats = row_floats * (size_t)biggest + 4 * (size_t)max_hg16 * sb;                   \
        float *buf = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);               \
        if (!buf) {                                                                                     \
            _Pragma("omp atomic write")                                                                 \
            failed = 1;                                                                                 \
        }                                                                                               \
        float *scores = buf + row_floats * (size_t)biggest;                                             \
        if (amx) amx_begin();                                                                           \
        /* items by an atomic counter, each thread holding the one it does next while items are many  \
         * (with few, holding one would starve the other threads): its first cache block is prefetched  \
         * during the current item's last instead of met cold (batch 64: 1.89 -> 1.80 ms a layer at 256 \
         * keys, 0.87 -> 0.81 at 128; long rows, whose first block is a smaller share, level) */          \
        const int ahead = total >= 8L * num_threads;                                                    \
        for (long work = take(&counter), upcoming = ahead ? take(&counter) : 0; work < total;            \
             work = ahead ? upcoming : take(&counter), upcoming = ahead ? take(&counter) : 0) {           \
            long upcoming_base = -1;                                                                    \
            if (ahead && upcoming < total) {                                                            \
                const WorkItem ui = items[upcoming / num_chunks];                                       \
                const RowGroup ug = groups[ui.group];                                                   \
                const int urow = order[ug.first];                                                       \
                int ustart = ug.shared > 0 ? 0 : first_key[urow];                                       \
                if (ui.seg >= 0 && ui.seg * seg_keys > ustart) ustart = ui.seg * seg_keys;              \
                if (ustart < row_keys[urow])                                                            \
                    upcoming_base = (((long)block_tables[(long)row_seq[urow] * max_blocks + ustart / block_size] * block_size \
                                      + ustart % block_size) * num_kv_heads + (long)(upcoming % num_chunks) * per) * head_dim; \
            }                                                                                           \
            if (!buf) continue;                                                                         \
            const WorkItem it = items[work / num_chunks];                                               \
            const RowGroup gr = groups[it.group];                                                       \
            const int kv0 = (int)(work % num_chunks) * per, h0 = kv0 * group;                           \
            const int nkv = num_kv_heads - kv0 < per ? num_kv_heads - kv0 : per, hg = nkv * group;      \
            for (int j = 0; j < gr.count; j++) {                                                        \
                const int row = order[gr.first + j];                                                    \
                const RowState st = row_state(buf, row_floats, j, max_hg, width);                       \
                QT *qf = (QT *)st.q; float *acc = st.acc, *m = st.m, *s = st.s;                         \
                for (int x = 0; x < hg; x++) {                                                          \
                    const T *qp = q + ((long)row * num_heads + h0 + x) * head_dim;                      \
                    for (int d = 0; d < qw; d++) qf[x * qw + d] = d < head_dim ? QLOAD(qp[d]) : (QT)0;  \
                    for (int d = 0; d < width; d++) acc[x * width + d] = 0.f;                           \
                    m[x] = -INFINITY; s[x] = 0.f;                                                       \
                }                                                                                       \
                if (amx) pack_qt(st.qt, (const uint16_t *)(q + ((long)row * num_heads + h0) * head_dim), hg, group, head_dim); \
            }                                                                                           \
            /* the shared blocks: each one read from memory once, by the group's first row */            \
            const int32_t *t0 = block_tables + (long)row_seq[order[gr.first]] * max_blocks;             \
            for (int b = 0; b < gr.shared; b++) {                                                       \
                if (b > 0 && b * block_size % seg_keys == 0) /* a segment ends: every row's partial */   \
                    for (int j = 0; j < gr.count; j++) {                                                \
                        const int row = order[gr.first + j];                                            \
                        const RowState st = row_state(buf, row_floats, j, max_hg, width);               \
                        flush_state(parts + ((size_t)part_off[row] + b * block_size / seg_keys - 1) * num_heads * pw, \
                                    h0, hg, width, st.acc, st.m, st.s);                                 \
                    }                                                                                   \
                const long base = ((long)t0[b] * block_size * num_kv_heads + kv0) * head_dim;           \
                const long next = b + 1 < gr.shared ? ((long)t0[b + 1] * block_size * num_kv_heads + kv0) * head_dim : -1; \
                for (int j0 = 0; j0 < gr.count; j0 += 4) { /* four rows at a time share the V reads */  \
                    const int rows = gr.count - j0 < 4 ? gr.count - j0 : 4;                             \
                    float *accs[4], *scs[4];                                                            \
                    for (int r = 0; r < rows; r++) {                                                    \
                        const int j = j0 + r;                                                           \
                        const RowState st = row_state(buf, row_floats, j, max_hg, width);               \
                        QT *qf = (QT *)st.q; float *acc = st.acc, *m = st.m, *s = st.s;                 \
                        accs[r] = acc; scs[r] = scores + (size_t)r * max_hg16 * sb;                       \
                        NAME##_scores(qf, acc, m, s, scs[r], k_cache + base, j == 0 ? v_cache + base : NULL, \
                                      amx ? st.qt : NULL, block_size, nkv, group, head_dim, width, qw, sb, \
                                      kv_stride, scale);                                                \
                    }                                                                                   \
                    const KT *kpf = j0 == 0 && next >= 0 ? k_cache + next : NULL; /* by the first call */ \
                    if (rows == 4)                                                                      \
                        NAME##_values(4, accs, (const float *const *)scs, v_cache + base, block_size, nkv, group, \
                                      head_dim, width, sb, kv_stride, kpf);                             \
                    if (rows == 2 || rows == 3)                                                         \
                        NAME##_values(2, accs, (const float *const *)scs, v_cache + base, block_size, nkv, group, \
                                      head_dim, width, sb, kv_stride, kpf);                             \
                    if (rows == 1 || rows == 3)                                                         \
                        NAME##_values(1, accs + rows - 1, (const float *const *)scs + rows - 1, v_cache + base, block_size, \
                                      nkv, group, head_dim, width, sb, kv_stride, rows == 1 ? kpf : NULL); \
                }                                                                                       \
            }                                                                                           \
            for (int j = 0; j < gr.count; j++) { /* each row's own blocks (or this segment's), then its output */ \
                const int row = order[gr.first + j], n_keys = row_keys[row];                            \
                const RowState st = row_state(buf, row_floats, j, max_hg, width);                       \
                QT *qf = (QT *)st.q; float *acc = st.acc, *m = st.m, *s = st.s;                         \
                const int32_t *table = block_tables + (long)row_seq[row] * max_blocks;                  \
                float *row_parts = parts ? parts + (size_t)part_off[row] * num_heads * pw : NULL;       \
                int start = gr.shared * block_size, end = n_keys, n; /* shared is 0 with a window */    \
                if (first_key[row] > start) start = first_key[row];                                     \
                if (it.seg >= 0) { /* one segment of a lone row */                                      \
                    if (it.seg * seg_keys > start) start = it.seg * seg_keys;                           \
                    if ((it.seg + 1) * seg_keys < end) end = (it.seg + 1) * seg_keys;                   \
                }                                                                                       \
                for (; start < end; start += n) {                                                       \
                    if (it.seg < 0 && start > first_key[row] && start % seg_keys == 0)                  \
                        flush_state(row_parts + (size_t)(start / seg_keys - 1 - first_seg[row]) * num_heads * pw, \
                                    h0, hg, width, acc, m, s);                                          \
                    const int off = start % block_size; /* nonzero only where a sliding window starts */ \
                    n = end - start < block_size - off ? end - start : block_size - off;                \
                    const long base = (((long)table[start / block_size] * block_size + off) * num_kv_heads + kv0) * head_dim; \
                    const long next = start + n < end                                                   \
                        ? ((long)table[start / block_size + 1] * block_size * num_kv_heads + kv0) * head_dim \
                        : j == gr.count - 1 ? upcoming_base : -1;                                       \
                    NAME##_scores(qf, acc, m, s, scores, k_cache + base, v_cache + base, \
                                  amx && off == 0 ? st.qt : NULL, n, nkv, group, head_dim, width, qw, sb, \
                                  kv_stride, scale);                                                    \
                    NAME##_values(1, &acc, (const float *const *)&scores, v_cache + base, n, nkv, group, head_dim, width, sb, \
                                  kv_stride, next >= 0 ? k_cache + next : NULL);                        \
                }                                                                                       \
                if (nseg[row] > 1) { /* this segment's partial; merged below */                         \
                    const int sg = it.seg >= 0 ? it.seg : (n_keys - 1) / seg_keys;                      \
                    flush_state(row_parts + (size_t)(sg - first_seg[row]) * num_heads * pw, h0, hg, width, acc, m, s); \
                    continue;                                                                           \
                }                                                                                       \
                for (int x = 0; x < hg; x++) {                                                          \
                    T *op = out + ((long)row * num_heads + h0 + x) * head_dim;                          \
                    const float inv = s[x] > 0.f ? 1.f / s[x] : 0.f;                                    \
                    for (int d = 0; d < head_dim; d++) STORE(op + d, acc[x * width + ACC_INDEX(d)] * inv); \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        if (amx) amx_end();                                                                             \
        _Pragma("omp barrier") /* every partial is in: each split row's segments, merged */             \
        _Pragma("omp for schedule(static)")                                                             \
        for (long w = 0; w < (long)num_split * num_heads; w++) {                                        \
            if (failed) continue;                                                                       \
            const int row = split_rows[w / num_heads], h = (int)(w % num_heads);                        \
            const float *p = parts + (size_t)part_off[row] * num_heads * pw + (size_t)h * pw;           \
            const size_t step = (size_t)num_heads * pw;                                                 \
            float mx = -INFINITY, tot = 0.f, a[MAX_HEAD_DIM];                                           \
            for (int sg = 0; sg < nseg[row]; sg++) if (p[sg * step] > mx) mx = p[sg * step];            \
            for (int d = 0; d < width; d++) a[d] = 0.f;                                                 \
            for (int sg = 0; sg < nseg[row]; sg++) {                                                    \
                const float *ps = p + sg * step;                                                        \
                const float c = ps[0] == -INFINITY ? 0.f : expf(ps[0] - mx);                            \
                tot += ps[1] * c;                                                                       \
                for (int d = 0; d < width; d++) a[d] += ps[2 + d] * c;                                  \
            }                                                                                           \
            T *op = out + ((long)row * num_heads + h) * head_dim;                                       \
            const float inv = tot > 0.f ? 1.f / tot : 0.f;                                              \
            for (int d = 0; d < head_dim; d++) STORE(op + d, a[ACC_INDEX(d)] * inv);                    \
        }                                                                                               \
        free(buf);                                                                                      \
    }                                                                                                   \
    free(ints);                                                                                         \
    free(groups);                                                                                       \
    free(items);                                                                                        \
    free(parts);                                                                                        \
    return failed ? -2 : 0;                                                                             \
}

/* q.k as 16 partial sums (the caller adds them up): the key widened to float32 16 elements at a time,
 * against a float32 query zero-padded to a multiple of 16. */
#define DEFINE_DOT_F32(NAME, KT, KLOAD16)                                                               \
static inline __m512 NAME(const float *q, const KT *k, int head_dim) {                                   \
    __m512 dot = _mm512_setzero_ps();                                                                   \
    for (int j = 0; j < head_dim; j += 16)                                                              \
        dot = _mm512_fmadd_ps(_mm512_load_ps(q + j), KLOAD16(k + j, mask_upto(head_dim - j)), dot);    \
    return dot;                                                                                         \
}
DEFINE_DOT_F32(dot_f32, float, load16_f32)
DEFINE_DOT_F32(dot_bf16, uint16_t, load16_bf16)
DEFINE_DOT_F32(dot_e5m2, uint8_t, load16_e5m2)

/* V as float32, 32 dims at a time (left of them real, the rest zero), in acc's layout. float32 and e5m2:
 * lo = dims 0-15, hi = 16-31. bfloat16: one 64-byte load split into lo = the even dims (shifted up) and
 * hi = the odd ones (masked), two ALU ops for 32 values where widening 16 at a time takes six; acc then
 * holds each 32-dim chunk as [even | odd], undone when the output is stored (acc_index). */
static inline __mmask16 mask_left(int n) { return n <= 0 ? (__mmask16)0 : mask_upto(n); }
static inline void vload32_f32(const float *p, int left, __m512 *lo, __m512 *hi) {
    *lo = _mm512_maskz_loadu_ps(mask_left(left), p);
    *hi = _mm512_maskz_loadu_ps(mask_left(left - 16), p + 16);
}
static inline void vload32_e5m2(const uint8_t *p, int left, __m512 *lo, __m512 *hi) {
    *lo = load16_e5m2(p, mask_left(left));
    *hi = load16_e5m2(p + 16, mask_left(left - 16));
}
static inline void vload32_bf16(const uint16_t *p, int left, __m512 *lo, __m512 *hi) {
    const __m512i x = _mm512_maskz_loadu_epi16(mask32_upto(left), p);
    *lo = bf16_even_f32(x);
    *hi = bf16_odd_f32(x);
}
static inline int acc_plain(int d) { return d; }
static inline int acc_even_odd(int d) { return (d & ~31) + (d & 1) * 16 + ((d & 31) >> 1); }
/* vpair32_bf16's order: dims 8L .. 8L + 3 of lane L in the low 16 slots (4L ..), 8L + 4 .. 8L + 7 in the high */
static inline int acc_unpack(int d) { return (d & ~31) + ((d >> 2) & 1) * 16 + ((d & 31) >> 3) * 4 + (d & 3); }

DEFINE_AVX512_KERNEL(paged_attention_f32, float, float, float, load_f32, dot_f32, vload32_f32, acc_plain,
                     store_f32, 0, no_lane_dots, 0)
DEFINE_AVX512_KERNEL(paged_attention_f32_e5m2, float, uint8_t, float, load_f32, dot_e5m2, vload32_e5m2,
                     acc_plain, store_f32, 0, no_lane_dots, 0)
DEFINE_AVX512_KERNEL(paged_attention_bf16_e5m2, uint16_t, uint8_t, float, bf16_to_f32, dot_e5m2, vload32_e5m2,
                     acc_plain, store_bf16, 0, no_lane_dots, 0)
#ifdef __AVX512BF16__
/* bfloat16 query and keys: vdpbf16ps multiplies 32 pairs and adds them in float32 in one instruction,
 * in place of two widenings and two FMAs per 16 elements. The products of two bfloat16 are exact in
 * float32, so only the order of the additions differs from dot_bf16. The query stays bfloat16 (it is
 * one) and zero-padded to a multiple of 32. */
static inline uint16_t load_bits(uint16_t x) { return x; }
static inline __m512 dot_bf16_dp(const uint16_t *q, const uint16_t *k, int head_dim) {
    __m512 dot = _mm512_setzero_ps();
    for (int j = 0; j < head_dim; j += 32) {
        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(q + j),
                               (__m512bh)_mm512_maskz_loadu_epi16(mask32_upto(head_dim - j), k + j));
    }
    return dot;
}
DEFINE_AVX512_KERNEL(paged_attention_bf16, uint16_t, uint16_t, uint16_t, load_bits, dot_bf16_dp, vload32_bf16,
                     (PAIRED_VALUES ? acc_unpack : acc_even_odd), store_bf16, HAVE_AMX_SCORES, lane_dots, PAIRED_VALUES)
#else
DEFINE_AVX512_KERNEL(paged_attention_bf16, uint16_t, uint16_t, float, bf16_to_f32, dot_bf16, vload32_bf16,
                     acc_even_odd, store_bf16, 0, no_lane_dots, 0)
#endif

#else /* portable */
#define IDENTITY(x) (x)
DEFINE_KERNEL(paged_attention_f32, float, float, IDENTITY, IDENTITY, IDENTITY)
DEFINE_KERNEL(paged_attention_bf16, uint16_t, uint16_t, bf16_to_f32, bf16_to_f32, f32_to_bf16)
DEFINE_KERNEL(paged_attention_f32_e5m2, float, uint8_t, IDENTITY, e5m2_to_f32, IDENTITY)
DEFINE_KERNEL(paged_attention_bf16_e5m2, uint16_t, uint8_t, bf16_to_f32, e5m2_to_f32, f32_to_bf16)

#endif
