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
 * Built at run time by asyncengine/layers/attention_cpu.py with gcc -O3 -march=native -fopenmp.
 *
 * Two implementations behind the same symbols, chosen at compile time: an AVX-512 one (x86 with
 * AVX512F/BW/VL) and a portable one that the compiler vectorises as it can. The AVX-512 one widens
 * bf16 K/V in registers (or, with AVX512-BF16, takes bfloat16 q.k with vdpbf16ps: 10% faster where the
 * keys are in cache, as a shared prefix's are), reduces each q.k dot with one horizontal add and then
 * scales it, prefetches the next cache block and takes the softmax exponentials 16 at a time with a
 * polynomial exp (Cephes' expf, ~1 ulp) instead of one libm expf call per key: 2-2.5x the portable
 * one's speed.
 */
#include <stdlib.h>

#include "cpu_common.h"

#define MAX_HEAD_DIM 512
#define MAX_BLOCK 256
#define MAX_GROUP 64

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
                keys[n_keyed++] = ((uint64_t)(uint32_t)block_tables[(long)i * max_blocks] << 32) | (uint32_t)r;
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

/* Row j's slice of a work item's scratch: its query (in the kernel's QT, cast by the caller) and acc,
 * [hg][width] floats each, then m and s [hg]; slices are row_floats apart. */
typedef struct { float *q, *acc, *m, *s; } RowState;
static inline RowState row_state(float *buf, size_t row_floats, int j, int max_hg, int width) {
    float *q = buf + row_floats * (size_t)j, *acc = q + (size_t)max_hg * width, *m = acc + (size_t)max_hg * width;
    return (RowState){q, acc, m, m + max_hg};
}

/* One row's heads over n keys of one cache block, in two halves: scores = q.k (one horizontal add per
 * key and head) and the online softmax over them (rescaling acc); then acc += p.v. kb/vb: the block's
 * first key at the run's first KV head. k_next/v_next: a block to prefetch (or NULL): a random address
 * the hardware prefetcher cannot guess; its rows are fetched one per key of this block, so the loads
 * overlap with this block's math. Into L2, not L1: a block's K and V (48 KiB at 12 heads of 64 in bfloat16)
 * are L1's size, and L1 holds this block (measured: 2.30 -> 2.25 ms a layer at batch 64). */
#define DEFINE_AVX512_BLOCK(NAME, QT, QDOT, KT, KLOAD16)                                                 \
static inline void NAME##_scores(const QT *qf, float *acc, float *m, float *s, float *scores,             \
                                 const KT *kb, const KT *k_next, const KT *v_next, int n, int nkv,        \
                                 int group, int head_dim, int width, int qw, int sb, long kv_stride,      \
                                 float scale) {                                                         \
    const int hg = nkv * group;                                                                         \
    for (int t = 0; t < n; t++) {                                                                       \
        if (k_next)                                                                                     \
            for (long b = 0; b < (long)nkv * head_dim * (long)sizeof(KT); b += 64) {                     \
                _mm_prefetch((const char *)(k_next + t * kv_stride) + b, _MM_HINT_T1);                   \
                _mm_prefetch((const char *)(v_next + t * kv_stride) + b, _MM_HINT_T1);                   \
            }                                                                                           \
        for (int x = 0; x < hg; x++) { /* x = local KV head * group + query head in its group */        \
            const KT *kp = kb + t * kv_stride + (x / group) * head_dim;                                  \
            scores[x * sb + t] = _mm512_reduce_add_ps(QDOT(qf + x * qw, kp, head_dim)) * scale;          \
        }                                                                                               \
    }                                                                                                   \
    for (int x = 0; x < hg; x++) { /* online softmax over this block */                                 \
        float *sc = scores + x * sb;                                                                    \
        __m512 mx = _mm512_set1_ps(-INFINITY);                                                          \
        for (int c = 0; c < n; c += 16) mx = _mm512_mask_max_ps(mx, mask_upto(n - c), mx, _mm512_loadu_ps(sc + c)); \
        const float bm = _mm512_reduce_max_ps(mx);                                                      \
        if (bm > m[x]) { /* rescale what was accumulated under the old maximum */                       \
            const float c = m[x] == -INFINITY ? 0.f : expf(m[x] - bm);                                  \
            s[x] *= c;                                                                                  \
            for (int j = 0; j < width; j += 16)                                                         \
                _mm512_store_ps(acc + x * width + j, _mm512_mul_ps(_mm512_load_ps(acc + x * width + j), _mm512_set1_ps(c))); \
            m[x] = bm;                                                                                  \
        }                                                                                               \
        __m512 sum = _mm512_setzero_ps();                                                               \
        const __m512 mv = _mm512_set1_ps(m[x]);                                                         \
        for (int c = 0; c < n; c += 16) {                                                               \
            const __mmask16 mk = mask_upto(n - c);                                                      \
            const __m512 p = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + c), mv))); \
            _mm512_mask_storeu_ps(sc + c, mk, p);                                                       \
            sum = _mm512_add_ps(sum, p);                                                                \
        }                                                                                               \
        s[x] += _mm512_reduce_add_ps(sum);                                                              \
    }                                                                                                   \
}                                                                                                       \
static inline void NAME##_values(float *acc, const float *scores, const KT *vb, int n, int nkv, int group, \
                                 int head_dim, int width, int sb, long kv_stride) {                     \
    for (int x = 0; x < nkv * group; x++) { /* acc += p . v, 16 dims in a register at a time */        \
        const float *sc = scores + x * sb;                                                              \
        const KT *vh = vb + (x / group) * head_dim;                                                     \
        for (int j = 0; j < width; j += 16) {                                                           \
            const __mmask16 mk = mask_upto(head_dim - j);                                               \
            __m512 a = _mm512_load_ps(acc + x * width + j);                                             \
            for (int t = 0; t < n; t++) a = _mm512_fmadd_ps(_mm512_set1_ps(sc[t]), KLOAD16(vh + t * kv_stride + j, mk), a); \
            _mm512_store_ps(acc + x * width + j, a);                                                    \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
/* acc += p.v for two or four rows over the same block: each V chunk widened once for all of them.     \
 * Every row adds the same products in the same order as NAME##_values. */                              \
static inline void NAME##_values2(float *const acc[2], const float *const scores[2], const KT *vb, int n, \
                                  int nkv, int group, int head_dim, int width, int sb, long kv_stride) { \
    for (int x = 0; x < nkv * group; x++) {                                                             \
        const KT *vh = vb + (x / group) * head_dim;                                                     \
        const float *s0 = scores[0] + x * sb, *s1 = scores[1] + x * sb;                                 \
        for (int j = 0; j < width; j += 16) {                                                           \
            const __mmask16 mk = mask_upto(head_dim - j);                                               \
            const long o = (long)x * width + j;                                                         \
            __m512 a0 = _mm512_load_ps(acc[0] + o), a1 = _mm512_load_ps(acc[1] + o);                    \
            for (int t = 0; t < n; t++) {                                                               \
                const __m512 v = KLOAD16(vh + t * kv_stride + j, mk);                                   \
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(s0[t]), v, a0);                                     \
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(s1[t]), v, a1);                                     \
            }                                                                                           \
            _mm512_store_ps(acc[0] + o, a0); _mm512_store_ps(acc[1] + o, a1);                           \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
static inline void NAME##_values4(float *const acc[4], const float *const scores[4], const KT *vb, int n, \
                                  int nkv, int group, int head_dim, int width, int sb, long kv_stride) { \
    for (int x = 0; x < nkv * group; x++) {                                                             \
        const KT *vh = vb + (x / group) * head_dim;                                                     \
        const float *s0 = scores[0] + x * sb, *s1 = scores[1] + x * sb, *s2 = scores[2] + x * sb, *s3 = scores[3] + x * sb; \
        for (int j = 0; j < width; j += 16) {                                                           \
            const __mmask16 mk = mask_upto(head_dim - j);                                               \
            const long o = (long)x * width + j;                                                         \
            __m512 a0 = _mm512_load_ps(acc[0] + o), a1 = _mm512_load_ps(acc[1] + o);                    \
            __m512 a2 = _mm512_load_ps(acc[2] + o), a3 = _mm512_load_ps(acc[3] + o);                    \
            for (int t = 0; t < n; t++) {                                                               \
                const __m512 v = KLOAD16(vh + t * kv_stride + j, mk);                                   \
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(s0[t]), v, a0);                                     \
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(s1[t]), v, a1);                                     \
                a2 = _mm512_fmadd_ps(_mm512_set1_ps(s2[t]), v, a2);                                     \
                a3 = _mm512_fmadd_ps(_mm512_set1_ps(s3[t]), v, a3);                                     \
            }                                                                                           \
            _mm512_store_ps(acc[0] + o, a0); _mm512_store_ps(acc[1] + o, a1);                           \
            _mm512_store_ps(acc[2] + o, a2); _mm512_store_ps(acc[3] + o, a3);                           \
        }                                                                                               \
    }                                                                                                   \
}

/* One work item = one group of rows and a run of `per` KV heads: all the heads while there are items
 * enough to keep the threads busy (the keys of a cache block are then one contiguous stream), fewer
 * while the largest item would hold more than a quarter of a thread's share of the work. */
#define DEFINE_AVX512_KERNEL(NAME, T, KT, QT, QLOAD, QDOT, KLOAD16, STORE)                               \
DEFINE_AVX512_BLOCK(NAME, QT, QDOT, KT, KLOAD16)                                                          \
int NAME(const T *q, const KT *k_cache, const KT *v_cache, T *out, const int32_t *block_tables,             \
         const int32_t *query_start, const int32_t *seq_lens, const uint8_t *skip, int num_seqs,          \
         int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,      \
         int window, int num_threads) {                                                                 \
    const int group = num_heads / num_kv_heads;                                                         \
    if (head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || group > MAX_GROUP) return -1;              \
    const int width = (head_dim + 15) / 16 * 16, sb = (block_size + 15) / 16 * 16;                      \
    const int qw = width * (int)(sizeof(float) / sizeof(QT)); /* q [hg][qw] as QDOT takes it, in width floats */ \
    const int num_rows = query_start[num_seqs];                                                         \
    if (num_rows <= 0) return 0;                                                                        \
    int *ints = (int *)malloc(sizeof(int) * 3 * (size_t)num_rows);                                     \
    RowGroup *groups = (RowGroup *)malloc(sizeof(RowGroup) * (size_t)num_rows);                         \
    if (!ints || !groups) { free(ints); free(groups); return -2; }                                      \
    int *row_seq = ints, *row_keys = ints + num_rows, *order = ints + 2 * num_rows;                     \
    int active = 0; /* rows the kernel computes */                                                      \
    for (int i = 0; i < num_seqs; i++) if (!(skip && skip[i])) active += query_start[i + 1] - query_start[i]; \
    const long share = (long)active * num_kv_heads / (4L * num_threads); /* row-heads: a quarter of a thread's */ \
    /* with a sliding window rows read different leading blocks: no groups */                          \
    const int max_group = window > 0 ? 1 : share / num_kv_heads > 2 ? (int)(share / num_kv_heads) : 2;  \
    const int num_groups = group_rows(block_tables, query_start, seq_lens, skip, num_seqs, max_blocks,  \
                                      block_size, max_group, row_seq, row_keys, order, groups);         \
    if (num_groups < 0) { free(ints); free(groups); return -2; }                                        \
    int biggest = 1;                                                                                    \
    for (int g = 0; g < num_groups; g++) if (groups[g].count > biggest) biggest = groups[g].count;       \
    int per = num_kv_heads; /* halve the head runs while there are too few items or too big ones */     \
    while (per > 1 && ((long)num_groups * ((num_kv_heads + per - 1) / per) < 4L * num_threads           \
                       || (long)biggest * per > share)) per = (per + 1) / 2;                            \
    const int num_chunks = (num_kv_heads + per - 1) / per;                                              \
    const long total = (long)num_groups * num_chunks, kv_stride = (long)num_kv_heads * head_dim;        \
    const int max_hg = per * group;                                                                     \
    /* one row's q, acc [hg][width]; m, s [hg]; rounded to 16 floats so every row's q and acc stay 64-byte aligned */ \
    const size_t row_floats = ((size_t)max_hg * (2 * width + 2) + 15) / 16 * 16;                      \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel num_threads(num_threads)")                                                    \
    {                                                                                                   \
        /* per thread: the rows' state for the biggest group, then scores [4][hg][sb] */                 \
        const size_t floats = row_floats * (size_t)biggest + 4 * (size_t)max_hg * sb;                   \
        float *buf = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);               \
        if (!buf) {                                                                                     \
            _Pragma("omp atomic write")                                                                 \
            failed = 1;                                                                                 \
        }                                                                                               \
        float *scores = buf + row_floats * (size_t)biggest;                                             \
        _Pragma("omp for schedule(dynamic, 1)")                                                         \
        for (long work = 0; work < total; work++) {                                                     \
            if (!buf) continue;                                                                         \
            const RowGroup gr = groups[work / num_chunks];                                              \
            const int kv0 = (int)(work % num_chunks) * per;                                             \
            const int nkv = num_kv_heads - kv0 < per ? num_kv_heads - kv0 : per, hg = nkv * group;      \
            for (int j = 0; j < gr.count; j++) {                                                        \
                const int row = order[gr.first + j];                                                    \
                const RowState st = row_state(buf, row_floats, j, max_hg, width);                       \
                QT *qf = (QT *)st.q; float *acc = st.acc, *m = st.m, *s = st.s;                         \
                for (int x = 0; x < hg; x++) {                                                          \
                    const T *qp = q + ((long)row * num_heads + kv0 * group + x) * head_dim;             \
                    for (int d = 0; d < qw; d++) qf[x * qw + d] = d < head_dim ? QLOAD(qp[d]) : (QT)0;  \
                    for (int d = 0; d < width; d++) acc[x * width + d] = 0.f;                           \
                    m[x] = -INFINITY; s[x] = 0.f;                                                       \
                }                                                                                       \
            }                                                                                           \
            /* the shared blocks: each one read from memory once, by the group's first row */            \
            const int32_t *t0 = block_tables + (long)row_seq[order[gr.first]] * max_blocks;             \
            for (int b = 0; b < gr.shared; b++) {                                                       \
                const long base = ((long)t0[b] * block_size * num_kv_heads + kv0) * head_dim;           \
                const long next = b + 1 < gr.shared ? ((long)t0[b + 1] * block_size * num_kv_heads + kv0) * head_dim : -1; \
                for (int j0 = 0; j0 < gr.count; j0 += 4) { /* four rows at a time share the V reads */  \
                    const int rows = gr.count - j0 < 4 ? gr.count - j0 : 4;                             \
                    float *accs[4], *scs[4];                                                            \
                    for (int r = 0; r < rows; r++) {                                                    \
                        const int j = j0 + r;                                                           \
                        const RowState st = row_state(buf, row_floats, j, max_hg, width);               \
                        QT *qf = (QT *)st.q; float *acc = st.acc, *m = st.m, *s = st.s;                 \
                        const int pf = j == 0 && next >= 0;                                             \
                        accs[r] = acc; scs[r] = scores + (size_t)r * max_hg * sb;                       \
                        NAME##_scores(qf, acc, m, s, scs[r], k_cache + base, pf ? k_cache + next : NULL, \
                                      pf ? v_cache + next : NULL, block_size, nkv, group, head_dim, width, qw, sb, \
                                      kv_stride, scale);                                                \
                    }                                                                                   \
                    if (rows == 4)                                                                      \
                        NAME##_values4(accs, (const float *const *)scs, v_cache + base, block_size, nkv, group, \
                                       head_dim, width, sb, kv_stride);                                 \
                    if (rows == 2 || rows == 3)                                                         \
                        NAME##_values2(accs, (const float *const *)scs, v_cache + base, block_size, nkv, group, \
                                       head_dim, width, sb, kv_stride);                                 \
                    if (rows == 1 || rows == 3)                                                         \
                        NAME##_values(accs[rows - 1], scs[rows - 1], v_cache + base, block_size, nkv, group, \
                                      head_dim, width, sb, kv_stride);                                  \
                }                                                                                       \
            }                                                                                           \
            for (int j = 0; j < gr.count; j++) { /* each row's own blocks, then its output */           \
                const int row = order[gr.first + j], n_keys = row_keys[row];                            \
                const RowState st = row_state(buf, row_floats, j, max_hg, width);                       \
                QT *qf = (QT *)st.q; float *acc = st.acc, *m = st.m, *s = st.s;                         \
                const int32_t *table = block_tables + (long)row_seq[row] * max_blocks;                  \
                int start = gr.shared * block_size, n; /* shared is 0 with a window */                  \
                if (window > 0 && n_keys - window > start) start = n_keys - window;                     \
                for (; start < n_keys; start += n) {                                                    \
                    const int off = start % block_size; /* nonzero only where a sliding window starts */ \
                    n = n_keys - start < block_size - off ? n_keys - start : block_size - off;          \
                    const long base = (((long)table[start / block_size] * block_size + off) * num_kv_heads + kv0) * head_dim; \
                    const long next = start + n < n_keys                                                \
                        ? ((long)table[start / block_size + 1] * block_size * num_kv_heads + kv0) * head_dim : -1; \
                    NAME##_scores(qf, acc, m, s, scores, k_cache + base, next >= 0 ? k_cache + next : NULL, \
                                  next >= 0 ? v_cache + next : NULL, n, nkv, group, head_dim, width, qw, sb, \
                                  kv_stride, scale);                                                    \
                    NAME##_values(acc, scores, v_cache + base, n, nkv, group, head_dim, width, sb, kv_stride); \
                }                                                                                       \
                for (int x = 0; x < hg; x++) {                                                          \
                    T *op = out + ((long)row * num_heads + kv0 * group + x) * head_dim;                 \
                    const float inv = s[x] > 0.f ? 1.f / s[x] : 0.f;                                    \
                    for (int d = 0; d < head_dim; d++) STORE(op + d, acc[x * width + d] * inv);         \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        free(buf);                                                                                      \
    }                                                                                                   \
    free(ints);                                                                                         \
    free(groups);                                                                                       \
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

DEFINE_AVX512_KERNEL(paged_attention_f32, float, float, float, load_f32, dot_f32, load16_f32, store_f32)
DEFINE_AVX512_KERNEL(paged_attention_f32_e5m2, float, uint8_t, float, load_f32, dot_e5m2, load16_e5m2, store_f32)
DEFINE_AVX512_KERNEL(paged_attention_bf16_e5m2, uint16_t, uint8_t, float, bf16_to_f32, dot_e5m2, load16_e5m2, store_bf16)
#ifdef __AVX512BF16__
/* bfloat16 query and keys: vdpbf16ps multiplies 32 pairs and adds them in float32 in one instruction,
 * in place of two widenings and two FMAs per 16 elements. The products of two bfloat16 are exact in
 * float32, so only the order of the additions differs from dot_bf16. The query stays bfloat16 (it is
 * one) and zero-padded to a multiple of 32. */
static inline uint16_t load_bits(uint16_t x) { return x; }
static inline __m512 dot_bf16_dp(const uint16_t *q, const uint16_t *k, int head_dim) {
    __m512 dot = _mm512_setzero_ps();
    for (int j = 0; j < head_dim; j += 32) {
        const __mmask32 mk = head_dim - j >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (head_dim - j)) - 1);
        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(q + j), (__m512bh)_mm512_maskz_loadu_epi16(mk, k + j));
    }
    return dot;
}
DEFINE_AVX512_KERNEL(paged_attention_bf16, uint16_t, uint16_t, uint16_t, load_bits, dot_bf16_dp, load16_bf16, store_bf16)
#else
DEFINE_AVX512_KERNEL(paged_attention_bf16, uint16_t, uint16_t, float, bf16_to_f32, dot_bf16, load16_bf16, store_bf16)
#endif

#else /* portable */
#define IDENTITY(x) (x)
DEFINE_KERNEL(paged_attention_f32, float, float, IDENTITY, IDENTITY, IDENTITY)
DEFINE_KERNEL(paged_attention_bf16, uint16_t, uint16_t, bf16_to_f32, bf16_to_f32, f32_to_bf16)
DEFINE_KERNEL(paged_attention_f32_e5m2, float, uint8_t, IDENTITY, e5m2_to_f32, IDENTITY)
DEFINE_KERNEL(paged_attention_bf16_e5m2, uint16_t, uint8_t, bf16_to_f32, e5m2_to_f32, f32_to_bf16)

#endif
