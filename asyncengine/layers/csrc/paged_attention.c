/* Paged attention on the CPU, reading K/V in place from the block-paged cache (no gather copies).
 *
 * For every query row r of sequence i (rows query_start[i] .. query_start[i+1]) and every head h,
 * attends causally over the first  seq_len[i] - q_len[i] + (r - query_start[i]) + 1  cached keys,
 * with an online softmax one cache block at a time.
 *
 * One OpenMP task handles one query row and a group of heads that share a KV head. It walks the
 * keys in cache order, so each key's [head_dim] vector is loaded once for all heads of the group;
 * rows whose sequence is long are split no further (decode rows are short work items already).
 * Layouts (contiguous): q/out [T, H, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D];
 * block_tables [B, max_blocks] int32; query_start [B + 1] int32; seq_lens [B] int32; skip [B] or NULL.
 * Built at run time by asyncengine/layers/attention_cpu.py with gcc -O3 -march=native -fopenmp.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 512
#define MAX_BLOCK 256
#define MAX_GROUP 64

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                              \
int NAME(const T *q, const T *k_cache, const T *v_cache, T *out, const int32_t *block_tables,             \
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
                const T *kp = k_cache + ((base + t) * num_kv_heads + kvh) * head_dim;                   \
                for (int g = 0; g < group; g++) {                                                       \
                    const float *qg = qf + g * head_dim;                                                \
                    float dot = 0.f;                                                                    \
                    _Pragma("omp simd reduction(+:dot)") /* vectorise without -ffast-math */            \
                    for (int d = 0; d < head_dim; d++) dot += qg[d] * LOAD(kp[d]);                      \
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
                const T *vp = v_cache + ((base + t) * num_kv_heads + kvh) * head_dim;                   \
                for (int g = 0; g < group; g++) {                                                       \
                    const float p = scores[g * block_size + t];                                         \
                    float *ag = acc + g * head_dim;                                                     \
                    for (int d = 0; d < head_dim; d++) ag[d] += p * LOAD(vp[d]);                        \
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

#define IDENTITY(x) (x)
DEFINE_KERNEL(paged_attention_f32, float, IDENTITY, IDENTITY)
DEFINE_KERNEL(paged_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
