/* Causal attention of prompt chunks in bfloat16 with AVX512-BF16 (vdpbf16ps), for CPUs without AMX: the
 * counterpart of amx_attention.c, with its interface and its work split.
 *
 * Why not torch's SDPA: on a 2-core AVX512-BF16 machine (AMD EPYC, no AMX) its bfloat16 causal kernel
 * reached 13 GFLOP/s at 256 tokens and 48-55 at 2048 (12 heads x 64), against 180-200 for a bfloat16
 * GEMM, and attention was ~40% of a prefill of 512-2048-token prompts. It also takes one call per prompt.
 * Here all of a step's prompt chunks go in one call and one OpenMP region.
 *
 * Per (sequence, KV head) the keys are copied as plain rows and the values packed as [key pair][dim][2],
 * zero past the sequence. Then per (sequence, head, tile of 16 query rows), the tile's query dim pairs
 * transposed (a 16 x 16 word transpose per 32 dims: [dim pair][16 rows]), over blocks of 64 keys (flash /
 * online softmax, so that a block's scores, probabilities and keys stay in L1):
 *     S^T = K Q^T                      vdpbf16ps, lanes over the 16 query rows, a key's dim pair broadcast
 *     m' = max(m, colmax(S^T) c2),     alpha = 2^(m - m')          c2 = scale * log2(e): base 2
 *     P^T = 2^(c2 S^T - m')            float32, causal / sliding-window mask; l = alpha l + colsum(P^T)
 *     O = alpha O + bf16(P) V          vdpbf16ps, lanes over 16 dims, a row's key pair of P broadcast
 * and at the end out = bf16(O / l): the arithmetic of torch's flash kernel for bfloat16 inputs (P rounded
 * to bfloat16 for the second product, the row sums and O kept in float32). With the rows in the lanes the
 * softmax is vector arithmetic only (softmax_rows: no horizontal reductions, no per-row scalar chain), and
 * its exponentials are exp2h_512's 7 instructions. Against the layout before (lanes over keys, per-row
 * reductions, Cephes exp in base e): 1.19-1.23x the kernel at 256-2048 tokens, mean error against float64
 * unchanged to four digits (2026-12-06, AMD EPYC, 2 threads).
 *
 * Query position of row i of a sequence: kv_len - q_len + i (the chunk is the last q_len positions of
 * the context); it sees keys j <= position, and with a sliding window W > 0 only j > position - W. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include "cpu_common.h" /* exp2h_512: the softmax's exponentials, as in amx_attention.c */
#include "prompt_attention.h" /* Call, the work plan; transpose16 (cpu_common.h) */
#include <omp.h>

#define QT 16 /* query rows per work item */
#define BK 64 /* keys per softmax block: S^T (4 KiB), P^T and the block's K and V stay in L1 */
#define RG 4  /* query rows per register block */
#define MAX_HEAD_DIM 256 /* any multiple of 32 up to this: whole 16 x 16 word transposes of Q */

int bf16_attention_available(void) { return 1; }

/* Sequence s, KV head g: its keys into kt ([key][D], keys rounded up to 16) and its values into vt ([key
 * pair][D][2], keys rounded up to 32), zero past its length. */
static void pack_kv(const Call *c, int s, int g, Unit u) {
    uint16_t *kt = u.k, *vt = u.v;
    const int len = c->seqs[4 * s + 3], D = c->D;
    const uint16_t *k = c->k + g * D, *v = c->v + g * D;
    for (int j = 0; j < ceil_to(len, 16); j++) {
        uint16_t *row = kt + (size_t)j * D;
        if (j + PACK_AHEAD < len) prefetch_bytes(k + key_row(c, s, j + PACK_AHEAD) * c->k_stride, 2 * D);
        const uint16_t *src = j < len ? k + key_row(c, s, j) * c->k_stride : NULL;
        for (int d = 0; d < D; d += 32) /* D a multiple of 32: whole vectors */
            _mm512_storeu_si512(row + d, src ? _mm512_loadu_si512(src + d) : _mm512_setzero_si512());
    }
    /* clang-format off */
    const __m512i inter = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                           39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    /* clang-format on */
    for (int p = 0; p < ceil_to(len, 32) / 2; p++) {
        for (int j = 2 * p + PACK_AHEAD; j < 2 * p + PACK_AHEAD + 2 && j < len; j++)
            prefetch_bytes(v + key_row(c, s, j) * c->v_stride, 2 * D);
        const uint16_t *a = 2 * p < len ? v + key_row(c, s, 2 * p) * c->v_stride : NULL;
        const uint16_t *b = 2 * p + 1 < len ? v + key_row(c, s, 2 * p + 1) * c->v_stride : NULL;
        for (int db = 0; db < D / 16; db++) {
            const __m512i x = a ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + db * 16)))
                                : _mm512_setzero_si512();
            const __m512i y = b ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + db * 16)))
                                : _mm512_setzero_si512();
            _mm512_storeu_si512(vt + (size_t)p * 2 * D + db * 32, _mm512_permutex2var_epi16(x, inter, y));
        }
    }
}

/* S^T [16 keys][16 rows] += for the n16 key groups of 16 at kt (key rows of D, plain): lanes over the 16
 * query rows of the tile, whose dim pairs qt [D / 2][16 rows] are packed transposed; each key's dim pair is
 * broadcast (embedded in vdpbf16ps). Inlined with the dimension constant, 16 accumulators a key group. */
static inline __attribute__((always_inline)) void qk_rows(const uint32_t *qt, const int D, const uint16_t *kt,
                                                          float *ST, int n16) {
    const int np = D / 2;
    for (int g = 0; g < n16; g++) {
        const uint32_t *kw = (const uint32_t *)(kt + (size_t)g * 16 * D);
        __m512 acc[16];
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
        for (int p = 0; p < np; p++) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt + p * 16);
            for (int j = 0; j < 16; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_set1_epi32((int)kw[j * np + p]));
        }
        for (int j = 0; j < 16; j++) _mm512_storeu_ps(ST + (g * 16 + j) * 16, acc[j]);
    }
}

/* P^T as bfloat16 pairs [key pair][16 rows]: 32-bit words holding keys 2p and 2p + 1 of a row, as pv_block
 * broadcasts them (bf16_pairs: cpu_common.h). */
static inline void store_bf16_pair(void *PT, int j, __m512 e0, __m512 e1) {
    _mm512_storeu_si512((uint32_t *)PT + (j / 2) * 16, bf16_pairs(e0, e1));
}
DEFINE_SOFTMAX_ROWS(softmax_rows, store_bf16_pair)

/* O[r] = alpha[r] O[r] + sum over key pairs p < np of P[r][2p .. 2p + 1] V[2p .. 2p + 1] for RG rows
 * (P rows BK apart, O rows D apart) and the NV x 16 dims from d0 (NV x RG accumulators). */
static inline __attribute__((always_inline)) void pv_chunk(const int NV, const uint32_t *PT, int r0,
                                                           const uint16_t *vt, int D, int d0, int np, float *O,
                                                           const float *alpha) {
    __m512 acc[RG][4];
    for (int r = 0; r < RG; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        const float *o = O + r * D + d0;
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * j), a);
    }
    for (int p = 0; p < np; p++) {
        __m512bh vv[4];
        for (int j = 0; j < NV; j++) {
            vv[j] = (__m512bh)_mm512_loadu_si512(vt + (size_t)p * 2 * D + 2 * d0 + 32 * j);
            KEEP_IN_REGISTER(vv[j]);
        }
        for (int r = 0; r < RG; r++) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)PT[p * 16 + r0 + r]);
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pb, vv[j]);
        }
    }
    for (int r = 0; r < RG; r++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(O + r * D + d0 + 16 * j, acc[r][j]);
}

/* pv_chunk over the head, 64 dims at a time (16 accumulators), the last 32 on their own where D is an odd
 * multiple of 32. */
static inline void pv_block(const uint32_t *PT, int r0, const uint16_t *vt, int D, int np, float *O,
                            const float *alpha) {
    int d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) pv_chunk(4, PT, r0, vt, D, d0, np, O, alpha);
    if (d0 < D) pv_chunk(2, PT, r0, vt, D, d0, np, O, alpha);
}

/* Query rows QT t .. QT t + QT - 1 of sequence s, head h, over the packed keys kt / values vt of its KV
 * head. The scratch (30 KiB at D = 256) lives on the stack: L1-resident, nothing to allocate. */
static void query_tile(const Call *c, void *scratch, int s, int h, int t, Unit u) {
    (void)scratch; /* on the stack, below */
    const uint16_t *kt = u.k, *vt = u.v;
    const int D = c->D, window = c->window;
    const float c2 = c->scale * 1.4426950408889634f; /* scores in base 2: softmax_rows */
    const int q_row = c->seqs[4 * s], q_len = c->seqs[4 * s + 1], kv_len = c->seqs[4 * s + 3];
    const int r0 = QT * t, nr = q_len - r0 < QT ? q_len - r0 : QT, groups = (nr + RG - 1) / RG;
    const int pos0 = kv_len - q_len + r0, end = pos0 + nr; /* keys 0 .. end - 1 at most */
    const int first = first_key(pos0, window);
    _Alignas(64) uint32_t QTw[MAX_HEAD_DIM / 2 * 16], PT[BK / 2 * 16];
    _Alignas(64) float ST[BK * 16], O[QT * MAX_HEAD_DIM], alpha[QT], lv[QT];
    /* the query rows' dim pairs transposed, [D / 2][16 rows] (zero for rows past nr) */
    for (int db = 0; db < D / 32; db++) {
        __m512i r16[16];
        for (int r = 0; r < 16; r++)
            r16[r] = r < nr ? _mm512_loadu_si512(c->q + (long)(q_row + r0 + r) * c->q_stride + h * D + db * 32)
                            : _mm512_setzero_si512();
        transpose16(r16);
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(QTw + (db * 16 + p) * 16, r16[p]);
    }
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    memset(O, 0, sizeof(float) * groups * RG * D);
    for (int kb = first / 16 * 16; kb < end; kb += BK) {
        const int n = end - kb < BK ? end - kb : BK, n16 = (n + 15) / 16;
        if (D == 64) /* the usual sizes with their loops unrolled */
            qk_rows(QTw, 64, kt + (size_t)kb * D, ST, n16);
        else if (D == 128)
            qk_rows(QTw, 128, kt + (size_t)kb * D, ST, n16);
        else
            qk_rows(QTw, D, kt + (size_t)kb * D, ST, n16);
        softmax_rows(ST, n16 * 16, kb, pos0, nr, window, c2, &m, &l, alpha, PT);
        /* the values of this block's keys start at key pair kb / 2 */
        for (int g = 0; g < groups; g++)
            pv_block(PT, g * RG, vt + (size_t)kb * D, D, 8 * n16, O + g * RG * D, alpha + g * RG);
    }
    _mm512_storeu_ps(lv, l);
    for (int r = 0; r < nr; r++) {
        uint16_t *o = c->out + (long)(q_row + r0 + r) * c->out_stride + h * D;
        const __m512 inv = _mm512_set1_ps(1.0f / lv[r]);
        for (int d = 0; d < D; d += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(O + r * D + d), inv);
            _mm256_storeu_si256((__m256i *)(o + d), bf16_pack(x)); /* torch's rounding: denormals kept */
        }
    }
}

/* The arguments and results of amx_attention_bf16 (amx_attention.c), for D a multiple of 32 up to 256:
 * seqs: [num_seqs][4] = first query row, query rows, first key row, key rows (rows of q/out and of k/v).
 * q, out [rows, H * D], k, v [rows, Hkv * D], each with its row stride in elements.
 * tables (or NULL): the keys are read in place from a paged cache, k / v its [blocks * block_size,
 * Hkv * D] rows; a sequence's third field is then the row of `tables` that holds its block table.
 * Returns 0; -1 for an unsupported shape (D not a multiple of 32 up to 256, H not a multiple of Hkv, more
 * query than key rows); -2 when scratch cannot be allocated. The work split is prompt_attention.h's
 * plan_work. */
int bf16_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k, long k_stride, const uint16_t *v,
                        long v_stride, uint16_t *out, long out_stride, const int *seqs, int num_seqs,
                        const int *tables, int table_stride, int block_size, int H, int Hkv, int D,
                        float scale, int window, int num_threads) {
    if (tables && block_size <= 0) return -1;
    if (D <= 0 || D % 32 || D > MAX_HEAD_DIM) return -1;
    Plan p;
    const int rc = plan_work(seqs, num_seqs, H, Hkv, D, QT, num_threads, &p);
    if (rc) {
        free_plan(&p);
        return rc > 0 ? 0 : rc;
    }
    /* clang-format off */
    const Call c = {q, k, v, out, q_stride, k_stride, v_stride, out_stride, seqs, tables, table_stride,
                    block_size, H, Hkv, D, window, scale};
    /* clang-format on */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    if (run_plan(&p, &c, QT, D, pack_kv, query_tile, NULL)) {
#pragma omp atomic write
        failed = 1;
    }
    free_plan(&p);
    return failed ? -2 : 0;
}

#else /* no AVX512-BF16 in this build: callers keep torch's SDPA */
int bf16_attention_available(void) { return 0; }
int bf16_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k, long k_stride, const uint16_t *v,
                        long v_stride, uint16_t *out, long out_stride, const int *seqs, int num_seqs,
                        const int *tables, int table_stride, int block_size, int H, int Hkv, int D,
                        float scale, int window, int num_threads) {
    /* clang-format off */
    (void)tables; (void)table_stride; (void)block_size;
    (void)q; (void)q_stride; (void)k; (void)k_stride; (void)v; (void)v_stride; (void)out; (void)out_stride;
    (void)seqs; (void)num_seqs; (void)H; (void)Hkv; (void)D; (void)scale; (void)window; (void)num_threads;
    /* clang-format on */
    return -3;
}
#endif
