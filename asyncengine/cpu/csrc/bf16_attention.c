/* Causal attention of prompt chunks in bfloat16 with AVX512-BF16 (vdpbf16ps), for CPUs without AMX: the
 * counterpart of amx_attention.c, with its interface and its work split.
 *
 * Why not torch's SDPA: on a 2-core AVX512-BF16 machine (AMD EPYC, no AMX) its bfloat16 causal kernel
 * reached 13 GFLOP/s at 256 tokens and 48-55 at 2048 (12 heads x 64), against 180-200 for a bfloat16
 * GEMM, and attention was ~40% of a prefill of 512-2048-token prompts. It also takes one call per prompt.
 * Here all of a step's prompt chunks go in one call and one OpenMP region.
 *
 * Per (sequence, KV head) the keys are packed as [16-key block][dim pair][16 keys][2] (a 16 x 16 word
 * transpose in registers, as amx_attention.c's K tiles) and the values as [key pair][dim][2], zero past
 * the sequence. Then per (sequence, head, tile of 16 query rows), over blocks of 64 keys (flash / online
 * softmax, so that a block's scores, probabilities and keys stay in L1):
 *     S = Q K^T                        vdpbf16ps, lanes over 16 keys, a query row's dim pair broadcast
 *     m' = max(m, rowmax(S * scale)),  alpha = exp(m - m')
 *     P = exp(S * scale - m')          float32, causal / sliding-window mask; l = alpha l + sum(P)
 *     O = alpha O + bf16(P) V          vdpbf16ps, lanes over 16 dims, a row's key pair of P broadcast
 * and at the end out = bf16(O / l): the arithmetic of torch's flash kernel for bfloat16 inputs (P rounded
 * to bfloat16 for the second product, the row sums and O kept in float32). The exponentials are taken in
 * base 2 (softmax_rows), four rows' steps side by side: 1.12-1.18x the kernel's speed with one row's step
 * at a time in base e (Cephes exp), mean error against float64 unchanged to four digits (2026-12-06).
 *
 * Query position of row i of a sequence: kv_len - q_len + i (the chunk is the last q_len positions of
 * the context); it sees keys j <= position, and with a sliding window W > 0 only j > position - W. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include "cpu_common.h" /* exp2h_512: the softmax's exponentials, as in amx_attention.c */
#include "prompt_attention.h" /* Call, the K transpose, the work plan */
#include <omp.h>

#define QT 16 /* query rows per work item */
#define BK 64 /* keys per softmax block: S (4 KiB), P and the block's K and V stay in L1 */
#define RG 4  /* query rows per register block */
#define MAX_HEAD_DIM 128

int bf16_attention_available(void) { return 1; }

/* Sequence s, KV head g: its keys into kt ([16-key block][D / 2 dim pairs][16 keys][2], keys rounded up
 * to 16) and its values into vt ([key pair][D][2], keys rounded up to 32), zero past its length. */
static void pack_kv(const Call *c, int s, int g, Unit u) {
    uint16_t *kt = u.k, *vt = u.v;
    const int len = c->seqs[4 * s + 3], D = c->D;
    const uint16_t *k = c->k + g * D, *v = c->v + g * D;
    for (int kb = 0; kb < ceil_to(len, 16) / 16; kb++)
        for (int db = 0; db < D / 32; db++) {
            __m512i r[16];
            for (int n = 0; n < 16; n++)
                r[n] = kb * 16 + n < len
                           ? _mm512_loadu_si512(k + key_row(c, s, kb * 16 + n) * c->k_stride + db * 32)
                           : _mm512_setzero_si512();
            transpose16(r);
            uint16_t *t = kt + ((size_t)kb * (D / 2) + db * 16) * 32;
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(t + p * 32, r[p]);
        }
    /* clang-format off */
    const __m512i inter = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                           39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    /* clang-format on */
    for (int p = 0; p < ceil_to(len, 32) / 2; p++) {
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

/* softmax_step (prompt_attention.h) in base 2 for RG rows at once, and this kernel's P rounded to bfloat16
 * anyway: the rows' scores scaled by scale * log2(e) (c2) and their running maxima m kept in those units,
 * so that e = 2^(c2 S - m') is one fmsub and exp2h_512 (7 instructions against Cephes' ~20; its relative
 * error, 1.7e-7, is far below P's rounding to bfloat16); a block's maximum is taken on the raw scores and
 * scaled once. The RG rows' steps are written side by side: one row's step is a chain of dependent
 * reductions and exponentials (~80 cycles a row and block measured, ~25 of instructions), and the rows
 * are independent. Row r sees keys lo[r] .. pos[r] (none with pos[r] < 0); P rows BK apart get bf16(e). */
static inline __attribute__((always_inline)) void softmax_rows(const float *S, int nb, int kb, const int *lo,
                                                               const int *pos, float c2, float *m, float *l,
                                                               float *alpha, uint16_t *P) {
    __mmask16 mk[RG][4];
    float mn[RG];
    for (int r = 0; r < RG; r++) {
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int n = 0; n < nb; n++) {
            mk[r][n] = valid_keys(kb + 16 * n, lo[r], pos[r]);
            mx = _mm512_mask_max_ps(mx, mk[r][n], mx, _mm512_loadu_ps(S + r * BK + 16 * n));
        }
        const float bm = _mm512_reduce_max_ps(mx) * c2;
        mn[r] = bm > m[r] ? bm : m[r];
    }
    /* alpha = 2^(m - m'): 1 where the maximum stays (a row that has seen no key yet included: its O and l are
     * zero), 0 on a row's first keys */
    __m512 d = _mm512_set1_ps(0.0f);
    for (int r = 0; r < RG; r++) d = _mm512_mask_mov_ps(d, (__mmask16)(1u << r), _mm512_set1_ps(m[r] - mn[r] + 0.5f));
    _Alignas(64) float a[16];
    _mm512_store_ps(a, exp2h_512(d));
    for (int r = 0; r < RG; r++) {
        alpha[r] = m[r] == mn[r] ? 1.0f : m[r] == -INFINITY ? 0.0f : a[r];
        const __m512 c2v = _mm512_set1_ps(c2), mh = _mm512_set1_ps(mn[r] - 0.5f); /* exp2h_512: 2^(y - 1/2) */
        __m512 sum = _mm512_setzero_ps();
        for (int n = 0; n < nb; n++) {
            const __m512 e =
                _mm512_maskz_mov_ps(mk[r][n], exp2h_512(_mm512_fmsub_ps(_mm512_loadu_ps(S + r * BK + 16 * n), c2v, mh)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(P + r * BK + 16 * n), (__m256i)_mm512_cvtneps_pbh(e));
        }
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
        m[r] = mn[r];
    }
}

/* S[r][16 n + l] = Q row r . key 16 n + l of the block at kt, for RG rows (D apart) and nb <= 4 16-key
 * blocks; S rows BK apart. Inlined with nb constant, so that the RG x nb accumulators stay in registers. */
static inline __attribute__((always_inline)) void qk_block(const uint16_t *Q, int D, const uint16_t *kt,
                                                           float *S, const int nb) {
    const int np = D / 2;
    const uint32_t *qw = (const uint32_t *)Q;
    __m512 acc[RG][4];
    for (int r = 0; r < RG; r++)
        for (int n = 0; n < nb; n++) acc[r][n] = _mm512_setzero_ps();
    for (int p = 0; p < np; p++) {
        __m512bh kv[4];
        for (int n = 0; n < nb; n++) kv[n] = (__m512bh)_mm512_loadu_si512(kt + ((size_t)n * np + p) * 32);
        for (int r = 0; r < RG; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qw[r * np + p]);
            for (int n = 0; n < nb; n++) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], qb, kv[n]);
        }
    }
    for (int r = 0; r < RG; r++)
        for (int n = 0; n < nb; n++) _mm512_storeu_ps(S + r * BK + 16 * n, acc[r][n]);
}

/* O[r] = alpha[r] O[r] + sum over key pairs p < np of P[r][2p .. 2p + 1] V[2p .. 2p + 1] for RG rows
 * (P rows BK apart, O rows D apart), 64 dims at a time (16 accumulators). */
static inline void pv_block(const uint16_t *P, const uint16_t *vt, int D, int np, float *O,
                            const float *alpha) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 acc[RG][4];
        for (int r = 0; r < RG; r++) {
            const __m512 a = _mm512_set1_ps(alpha[r]);
            const float *o = O + r * D + d0;
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * j), a);
        }
        for (int p = 0; p < np; p++) {
            __m512bh vv[4];
            for (int j = 0; j < 4; j++)
                vv[j] = (__m512bh)_mm512_loadu_si512(vt + (size_t)p * 2 * D + 2 * d0 + 32 * j);
            for (int r = 0; r < RG; r++) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)(P + r * BK))[p]);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pb, vv[j]);
            }
        }
        for (int r = 0; r < RG; r++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(O + r * D + d0 + 16 * j, acc[r][j]);
    }
}

/* Query rows QT t .. QT t + QT - 1 of sequence s, head h, over the packed keys kt / values vt of its KV
 * head. The scratch (18 KiB at D = 128) lives on the stack: L1-resident, nothing to allocate. */
static void query_tile(const Call *c, void *scratch, int s, int h, int t, Unit u) {
    (void)scratch; /* on the stack, below */
    const uint16_t *kt = u.k, *vt = u.v;
    const int D = c->D, window = c->window;
    const float c2 = c->scale * 1.4426950408889634f; /* scores in base 2: softmax_step2 */
    const int q_row = c->seqs[4 * s], q_len = c->seqs[4 * s + 1], kv_len = c->seqs[4 * s + 3];
    const int r0 = QT * t, nr = q_len - r0 < QT ? q_len - r0 : QT, groups = (nr + RG - 1) / RG;
    const int pos0 = kv_len - q_len + r0, end = pos0 + nr; /* keys 0 .. end - 1 at most */
    const int first = first_key(pos0, window);
    _Alignas(64) uint16_t Q[QT * MAX_HEAD_DIM], P[QT * BK];
    _Alignas(64) float S[QT * BK], O[QT * MAX_HEAD_DIM];
    float m[QT], l[QT], alpha[QT];
    /* the query rows, zero-padded to whole register blocks (a padding row's scores are 0, its P is 0) */
    for (int r = 0; r < groups * RG; r++) {
        if (r < nr)
            memcpy(Q + r * D, c->q + (long)(q_row + r0 + r) * c->q_stride + h * D, sizeof(uint16_t) * D);
        else
            memset(Q + r * D, 0, sizeof(uint16_t) * D);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(O, 0, sizeof(float) * groups * RG * D);
    for (int kb = first / 16 * 16; kb < end; kb += BK) {
        const int nb = ((end - kb < BK ? end - kb : BK) + 15) / 16;
        const uint16_t *kblk = kt + (size_t)kb * D; /* 16-key blocks of 16 * D elements */
        for (int g = 0; g < groups; g++) {
            const uint16_t *qg = Q + g * RG * D;
            float *sg = S + g * RG * BK;
            switch (nb) {
            case 4: qk_block(qg, D, kblk, sg, 4); break;
            case 3: qk_block(qg, D, kblk, sg, 3); break;
            case 2: qk_block(qg, D, kblk, sg, 2); break;
            default: qk_block(qg, D, kblk, sg, 1); break;
            }
        }
        /* online softmax: each row's running max m and sum l, its P = bf16(exp) for this block (zero on
         * masked keys), alpha the factor its O is rescaled by */
        for (int g = 0; g < groups; g++) {
            int lo[RG], pos[RG];
            for (int i = 0; i < RG; i++) {
                const int r = g * RG + i;
                pos[i] = r < nr ? pos0 + r : -1; /* a padding row sees no key: its P is zero */
                lo[i] = first_key(pos[i], window);
            }
            softmax_rows(S + g * RG * BK, nb, kb, lo, pos, c2, m + g * RG, l + g * RG, alpha + g * RG,
                         P + g * RG * BK);
        }
        /* the values of this block's keys start at key pair kb / 2 */
        for (int g = 0; g < groups; g++)
            pv_block(P + g * RG * BK, vt + (size_t)kb * D, D, 8 * nb, O + g * RG * D, alpha + g * RG);
    }
    for (int r = 0; r < nr; r++) {
        uint16_t *o = c->out + (long)(q_row + r0 + r) * c->out_stride + h * D;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int d = 0; d < D; d += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(O + r * D + d), inv);
            _mm256_storeu_si256((__m256i *)(o + d), (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
}

/* The arguments and results of amx_attention_bf16 (amx_attention.c), for D = 64 or 128:
 * seqs: [num_seqs][4] = first query row, query rows, first key row, key rows (rows of q/out and of k/v).
 * q, out [rows, H * D], k, v [rows, Hkv * D], each with its row stride in elements.
 * tables (or NULL): the keys are read in place from a paged cache, k / v its [blocks * block_size,
 * Hkv * D] rows; a sequence's third field is then the row of `tables` that holds its block table.
 * Returns 0; -1 for an unsupported shape (D not 64 or 128, H not a multiple of Hkv, more query than key
 * rows); -2 when scratch cannot be allocated. The work split is prompt_attention.h's plan_work. */
int bf16_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k, long k_stride, const uint16_t *v,
                        long v_stride, uint16_t *out, long out_stride, const int *seqs, int num_seqs,
                        const int *tables, int table_stride, int block_size, int H, int Hkv, int D,
                        float scale, int window, int num_threads) {
    if (tables && block_size <= 0) return -1;
    if (D != 64 && D != 128) return -1;
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
#pragma omp parallel num_threads(num_threads)
    run_plan(&p, &c, QT, D, pack_kv, query_tile, NULL);
    free_plan(&p);
    return 0;
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
