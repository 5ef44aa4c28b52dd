/* Paged attention on the CPU, reading K/V in place from the block-paged cache (no gather copies).
 *
 * For every query row r of sequence i (rows query_start[i] .. query_start[i+1]) and every head h,
 * attends causally over the first  seq_len[i] - q_len[i] + (r - query_start[i]) + 1  cached keys,
 * with an online softmax one cache block at a time.
 *
 * One OpenMP task handles one query row and a group of heads that share a KV head. It walks the
 * keys in cache order, so each key's [head_dim] vector is loaded once for all heads of the group;
 * rows whose sequence is long are split no further (decode rows are short work items already).
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
         int num_threads) {                                                                             \
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
        for (int start = 0; start < n_keys; start += block_size) {                                      \
            const int n = n_keys - start < block_size ? n_keys - start : block_size;                    \
            const long base = (long)table[start / block_size] * block_size;                             \
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

/* One work item = one query row and a run of `per` KV heads (all of them when there are rows enough to
 * keep the threads busy): the keys of a cache block are then read as one contiguous stream. */
#define DEFINE_AVX512_KERNEL(NAME, T, KT, QT, QLOAD, QDOT, KLOAD16, STORE)                                           \
int NAME(const T *q, const KT *k_cache, const KT *v_cache, T *out, const int32_t *block_tables,             \
         const int32_t *query_start, const int32_t *seq_lens, const uint8_t *skip, int num_seqs,          \
         int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks, float scale,      \
         int num_threads) {                                                                             \
    const int group = num_heads / num_kv_heads;                                                         \
    if (head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK || group > MAX_GROUP) return -1;              \
    const int width = (head_dim + 15) / 16 * 16, sb = (block_size + 15) / 16 * 16;                      \
    const int num_rows = query_start[num_seqs];                                                         \
    int per = num_kv_heads; /* halve the head runs until there are ~4 items per thread */               \
    while (per > 1 && (long)num_rows * ((num_kv_heads + per - 1) / per) < 4L * num_threads) per = (per + 1) / 2; \
    const int num_chunks = (num_kv_heads + per - 1) / per;                                              \
    const long total = (long)num_rows * num_chunks, kv_stride = (long)num_kv_heads * head_dim;          \
    const int max_hg = per * group;                                                                     \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel num_threads(num_threads)")                                                    \
    {                                                                                                   \
        /* per thread: q, acc [hg][width]; scores [hg][sb]; m, s [hg] */                                 \
        const size_t floats = (size_t)max_hg * (2 * width + sb + 2);                                    \
        float *buf = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);               \
        if (!buf) {                                                                                     \
            _Pragma("omp atomic write")                                                                 \
            failed = 1;                                                                                 \
        }                                                                                               \
        QT *qf = (QT *)buf; /* [hg][qw]: the query as QDOT takes it, zero past head_dim */              \
        const int qw = width * (int)(sizeof(float) / sizeof(QT));                                       \
        float *acc = buf + max_hg * width, *scores = acc + max_hg * width;                              \
        float *m = scores + max_hg * sb, *s = m + max_hg;                                               \
        _Pragma("omp for schedule(dynamic, 1)")                                                         \
        for (long work = 0; work < total; work++) {                                                     \
            if (!buf) continue;                                                                         \
            const int row = (int)(work / num_chunks), kv0 = (int)(work % num_chunks) * per;             \
            const int nkv = num_kv_heads - kv0 < per ? num_kv_heads - kv0 : per, hg = nkv * group;      \
            int lo = 0, hi = num_seqs - 1; /* the sequence owning `row` */                              \
            while (lo < hi) { int mid = (lo + hi + 1) / 2; if (query_start[mid] <= row) lo = mid; else hi = mid - 1; } \
            const int i = lo;                                                                           \
            if (skip && skip[i]) continue;                                                              \
            const int q_len = query_start[i + 1] - query_start[i];                                      \
            const int n_keys = seq_lens[i] - q_len + (row - query_start[i]) + 1;                        \
            for (int x = 0; x < hg; x++) { /* x = local KV head * group + query head in its group */    \
                const T *qp = q + ((long)row * num_heads + kv0 * group + x) * head_dim;                 \
                for (int d = 0; d < qw; d++) qf[x * qw + d] = d < head_dim ? QLOAD(qp[d]) : (QT)0;      \
                for (int d = 0; d < width; d++) acc[x * width + d] = 0.f;                               \
                m[x] = -INFINITY; s[x] = 0.f;                                                           \
            }                                                                                           \
            const int32_t *table = block_tables + (long)i * max_blocks;                                 \
            for (int start = 0; start < n_keys; start += block_size) {                                  \
                const int n = n_keys - start < block_size ? n_keys - start : block_size;                \
                const long base = ((long)table[start / block_size] * block_size * num_kv_heads + kv0) * head_dim; \
                /* the next block: a random address the hardware prefetcher cannot guess; its rows are   \
                   fetched one per key of this block, so the loads overlap with this block's math */      \
                const long next = start + block_size < n_keys                                            \
                    ? ((long)table[start / block_size + 1] * block_size * num_kv_heads + kv0) * head_dim : -1; \
                const KT *kb = k_cache + base, *vb = v_cache + base; /* row t, local KV head h: + t * kv_stride + h * head_dim */ \
                for (int t = 0; t < n; t++) { /* scores = q . k, one horizontal add per (key, head) */   \
                    if (next >= 0)                                                                      \
                        for (long b = 0; b < (long)nkv * head_dim * (long)sizeof(KT); b += 64) {         \
                            _mm_prefetch((const char *)(k_cache + next + t * kv_stride) + b, _MM_HINT_T0); \
                            _mm_prefetch((const char *)(v_cache + next + t * kv_stride) + b, _MM_HINT_T0); \
                        }                                                                               \
                    for (int x = 0; x < hg; x++) {                                                      \
                        const KT *kp = kb + t * kv_stride + (x / group) * head_dim;                      \
                        scores[x * sb + t] = _mm512_reduce_add_ps(QDOT(qf + x * qw, kp, head_dim)) * scale; \
                    }                                                                                   \
                }                                                                                       \
                for (int x = 0; x < hg; x++) { /* online softmax over this block */                     \
                    float *sc = scores + x * sb;                                                        \
                    __m512 mx = _mm512_set1_ps(-INFINITY);                                              \
                    for (int c = 0; c < n; c += 16)                                                     \
                        mx = _mm512_mask_max_ps(mx, mask_upto(n - c), mx, _mm512_loadu_ps(sc + c));     \
                    const float bm = _mm512_reduce_max_ps(mx);                                          \
                    if (bm > m[x]) { /* rescale what was accumulated under the old maximum */           \
                        const float c = m[x] == -INFINITY ? 0.f : expf(m[x] - bm);                      \
                        s[x] *= c;                                                                      \
                        for (int j = 0; j < width; j += 16)                                             \
                            _mm512_store_ps(acc + x * width + j, _mm512_mul_ps(_mm512_load_ps(acc + x * width + j), _mm512_set1_ps(c))); \
                        m[x] = bm;                                                                      \
                    }                                                                                   \
                    __m512 sum = _mm512_setzero_ps();                                                   \
                    const __m512 mv = _mm512_set1_ps(m[x]);                                             \
                    for (int c = 0; c < n; c += 16) {                                                   \
                        const __mmask16 mk = mask_upto(n - c);                                          \
                        const __m512 p = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + c), mv))); \
                        _mm512_mask_storeu_ps(sc + c, mk, p);                                           \
                        sum = _mm512_add_ps(sum, p);                                                    \
                    }                                                                                   \
                    s[x] += _mm512_reduce_add_ps(sum);                                                  \
                }                                                                                       \
                for (int x = 0; x < hg; x++) { /* acc += p . v, 16 dims in a register at a time */      \
                    const float *sc = scores + x * sb;                                                  \
                    const KT *vh = vb + (x / group) * head_dim;                                          \
                    for (int j = 0; j < width; j += 16) {                                               \
                        const __mmask16 mk = mask_upto(head_dim - j);                                   \
                        __m512 a = _mm512_load_ps(acc + x * width + j);                                 \
                        for (int t = 0; t < n; t++)                                                     \
                            a = _mm512_fmadd_ps(_mm512_set1_ps(sc[t]), KLOAD16(vh + t * kv_stride + j, mk), a);\
                        _mm512_store_ps(acc + x * width + j, a);                                        \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
            for (int x = 0; x < hg; x++) {                                                              \
                T *op = out + ((long)row * num_heads + kv0 * group + x) * head_dim;                     \
                const float inv = s[x] > 0.f ? 1.f / s[x] : 0.f;                                        \
                for (int d = 0; d < head_dim; d++) STORE(op + d, acc[x * width + d] * inv);             \
            }                                                                                           \
        }                                                                                               \
        free(buf);                                                                                      \
    }                                                                                                   \
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
