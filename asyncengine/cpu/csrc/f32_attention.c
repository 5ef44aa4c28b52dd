/* Causal attention of prompt chunks in float32 with AVX-512 FMAs: the float32 counterpart of
 * bf16_attention.c, with its interface (prompt_attention.h's Call, its work plan), its blocking and its
 * softmax (DEFINE_SOFTMAX_ROWS).
 *
 * Why not torch's SDPA: its float32 flash kernel ran at 103-179 GFLOP/s on two cores of a Xeon with AMX at
 * 512-2048-token prompts (a third to half of the FMA units' peak) and took ~21% of a float32 prefill of
 * such prompts, one call per prompt; a chunk after cached context went through a gathered copy of its
 * keys and an explicit mask, without skipping the masked blocks. Here all of a step's prompt chunks go in
 * one call, the keys are read in place through the block tables, and only the causal blocks are computed.
 *
 * Per (sequence, KV head) the keys and the values are copied as plain rows ([key][D], zero past the
 * sequence, rounded up to 16 keys). Then per (sequence, head, tile of 16 query rows), the tile's queries
 * transposed ([D][16 rows]), over blocks of 64 keys (flash / online softmax: a block's scores and
 * probabilities stay in L1):
 *     S^T = K Q^T                      FMAs, lanes over the 16 query rows, a key's element broadcast
 *     m' = max(m, colmax(S^T) c2),     alpha = 2^(m - m')          c2 = scale * log2(e): base 2
 *     P^T = 2^(c2 S^T - m')            causal / sliding-window mask; l = alpha l + colsum(P^T)
 *     O = alpha O + P V                FMAs, lanes over 16 dims, a row's P broadcast
 * and at the end out = O / l, all in float32 (the arithmetic of torch's flash kernel in float32, the
 * exponentials in base 2 (exp2h_512); the sums run in another order, so results differ from SDPA's by
 * float32 rounding). With the rows in the lanes the softmax is vector arithmetic only: the layout before
 * (lanes over keys, Q broadcast, per-row maxima and sums as horizontal reductions, a libm expf per row
 * and block, Cephes exp in base e) spent a third of the kernel's time outside its FMA loops.
 *
 * Query position of row i of a sequence: kv_len - q_len + i (the chunk is the last q_len positions of
 * the context); it sees keys j <= position, and with a sliding window W > 0 only j > position - W. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include "cpu_common.h" /* exp2h_512, prefetch_bytes */
#include "prompt_attention.h" /* Call, the work plan, the softmax step; transpose16 (cpu_common.h) */
#include <omp.h>

#define QT 16 /* query rows per work item */
#define BK 64 /* keys per softmax block: S^T (4 KiB) and P^T stay in L1 */
#define RG 4  /* query rows per register block of the p.v product */
#define MAX_HEAD_DIM 256

int f32_attention_available(void) { return 1; }

/* The plan and the packed units count elements of 16 bits (prompt_attention.h): a float32 unit of head
 * dim D takes the room of a 16-bit one of 2 D. */
#define UNIT_D(D) (2 * (D))

/* Sequence s, KV head g: its keys into kt and its values into vt, both [key][D] with keys rounded up to
 * 16, zero past its length. */
static void pack_kv(const Call *c, int s, int g, Unit u) {
    float *kt = u.k, *vt = u.v;
    const int len = c->seqs[4 * s + 3], D = c->D;
    const float *k = (const float *)c->k + g * D, *v = (const float *)c->v + g * D;
    for (int j = 0; j < ceil_to(len, 16); j++) {
        if (j + PACK_AHEAD < len) {
            const long ahead = key_row(c, s, j + PACK_AHEAD);
            prefetch_bytes(k + ahead * c->k_stride, 4 * D);
            prefetch_bytes(v + ahead * c->v_stride, 4 * D);
        }
        const long row = j < len ? key_row(c, s, j) : -1;
        for (int d = 0; d < D; d += 16) { /* D is a multiple of 16 */
            _mm512_storeu_ps(kt + (size_t)j * D + d,
                             row >= 0 ? _mm512_loadu_ps(k + row * c->k_stride + d) : _mm512_setzero_ps());
            _mm512_storeu_ps(vt + (size_t)j * D + d,
                             row >= 0 ? _mm512_loadu_ps(v + row * c->v_stride + d) : _mm512_setzero_ps());
        }
    }
}

/* S^T [16 keys][16 rows] for the n16 key groups of 16 at kt (key rows of D): lanes over the tile's 16 query
 * rows, whose elements qt [D][16 rows] are packed transposed; each key's element is broadcast (embedded in
 * the FMA). Inlined with the dimension constant where it is 64 or 128, 16 accumulators a key group. */
static inline __attribute__((always_inline)) void qk_rows(const float *qt, const int D, const float *kt, float *ST,
                                                          int n16) {
    for (int g = 0; g < n16; g++) {
        const float *kg = kt + (size_t)g * 16 * D;
        __m512 acc[16];
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m512 qv = _mm512_loadu_ps(qt + d * 16);
            for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kg[j * D + d]), acc[j]);
        }
        for (int j = 0; j < 16; j++) _mm512_storeu_ps(ST + (g * 16 + j) * 16, acc[j]);
    }
}

/* P^T as float32 [key][16 rows]. */
static inline void store_f32_pair(void *PT, int j, __m512 e0, __m512 e1) {
    _mm512_storeu_ps((float *)PT + j * 16, e0);
    _mm512_storeu_ps((float *)PT + (j + 1) * 16, e1);
}
DEFINE_SOFTMAX_ROWS(softmax_rows, store_f32_pair)

/* O[r][d0 ..] = alpha[r] O[r][d0 ..] + sum over keys j < nk of P[r][j] V[j][d0 ..], `nv` <= 4 vectors of 16
 * dims, RG rows r0 .. r0 + RG - 1 of P^T [key][16 rows] (O rows D apart). Inlined with nv constant, so that
 * the RG x nv accumulators stay in registers. */
static inline __attribute__((always_inline)) void pv_part(const float *PT, int r0, const float *vt, int D, int nk,
                                                          float *O, const float *alpha, int d0, const int nv) {
    __m512 acc[RG][4];
    for (int r = 0; r < RG; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int j = 0; j < nv; j++) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(O + r * D + d0 + 16 * j), a);
    }
    for (int key = 0; key < nk; key++) {
        __m512 vv[4];
        for (int j = 0; j < nv; j++) {
            vv[j] = _mm512_loadu_ps(vt + (size_t)key * D + d0 + 16 * j);
            KEEP_IN_REGISTER(vv[j]);
        }
        for (int r = 0; r < RG; r++) {
            const __m512 pb = _mm512_set1_ps(PT[key * 16 + r0 + r]);
            for (int j = 0; j < nv; j++) acc[r][j] = _mm512_fmadd_ps(pb, vv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < RG; r++)
        for (int j = 0; j < nv; j++) _mm512_storeu_ps(O + r * D + d0 + 16 * j, acc[r][j]);
}
static inline void pv_block(const float *PT, int r0, const float *vt, int D, int nk, float *O, const float *alpha) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        switch ((D - d0) / 16) {
        case 1: pv_part(PT, r0, vt, D, nk, O, alpha, d0, 1); break;
        case 2: pv_part(PT, r0, vt, D, nk, O, alpha, d0, 2); break;
        case 3: pv_part(PT, r0, vt, D, nk, O, alpha, d0, 3); break;
        default: pv_part(PT, r0, vt, D, nk, O, alpha, d0, 4); break;
        }
    }
}

/* Query rows QT t .. QT t + QT - 1 of sequence s, head h, over the packed keys kt / values vt of its KV
 * head. The scratch (~40 KiB at D = 256) lives on the stack: L1/L2-resident, nothing to allocate. */
static void query_tile(const Call *c, void *scratch, int s, int h, int t, Unit u) {
    (void)scratch; /* on the stack, below */
    const float *kt = u.k, *vt = u.v;
    const int D = c->D, window = c->window;
    const float c2 = c->scale * 1.4426950408889634f; /* scores in base 2: softmax_rows */
    const int q_row = c->seqs[4 * s], q_len = c->seqs[4 * s + 1], kv_len = c->seqs[4 * s + 3];
    const int r0 = QT * t, nr = q_len - r0 < QT ? q_len - r0 : QT, groups = (nr + RG - 1) / RG;
    const int pos0 = kv_len - q_len + r0, end = pos0 + nr; /* keys 0 .. end - 1 at most */
    const int first = first_key(pos0, window);
    _Alignas(64) float QTf[MAX_HEAD_DIM * 16], ST[BK * 16], PT[BK * 16], O[QT * MAX_HEAD_DIM], alpha[QT], lv[QT];
    const float *q = (const float *)c->q;
    /* the query rows transposed, [D][16 rows] (zero for rows past nr) */
    for (int db = 0; db < D / 16; db++) {
        __m512i r16[16];
        for (int r = 0; r < 16; r++)
            r16[r] = r < nr ? _mm512_loadu_si512(q + (long)(q_row + r0 + r) * c->q_stride + h * D + db * 16)
                            : _mm512_setzero_si512();
        transpose16(r16);
        for (int d = 0; d < 16; d++) _mm512_storeu_si512(QTf + (db * 16 + d) * 16, r16[d]);
    }
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    memset(O, 0, sizeof(float) * groups * RG * D);
    for (int kb = first / 16 * 16; kb < end; kb += BK) {
        const int n = end - kb < BK ? end - kb : BK, n16 = (n + 15) / 16;
        switch (D) {
        case 64: qk_rows(QTf, 64, kt + (size_t)kb * D, ST, n16); break;
        case 128: qk_rows(QTf, 128, kt + (size_t)kb * D, ST, n16); break;
        default: qk_rows(QTf, D, kt + (size_t)kb * D, ST, n16); break;
        }
        softmax_rows(ST, n16 * 16, kb, pos0, nr, window, c2, &m, &l, alpha, PT);
        for (int g = 0; g < groups; g++)
            pv_block(PT, g * RG, vt + (size_t)kb * D, D, 16 * n16, O + g * RG * D, alpha + g * RG);
    }
    _mm512_storeu_ps(lv, l);
    float *out = (float *)c->out;
    for (int r = 0; r < nr; r++) {
        float *o = out + (long)(q_row + r0 + r) * c->out_stride + h * D;
        const __m512 inv = _mm512_set1_ps(1.0f / lv[r]);
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(O + r * D + d), inv));
    }
}

/* The arguments and results of bf16_attention_bf16 with float32 q, k, v and out, for D a multiple of 16
 * up to 256. Returns 0; -1 for an unsupported shape (D, H not a multiple of Hkv, more query than key rows);
 * -2 when scratch cannot be allocated. */
int f32_attention_f32(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                      long v_stride, float *out, long out_stride, const int *seqs, int num_seqs,
                      const int *tables, int table_stride, int block_size, int H, int Hkv, int D, float scale,
                      int window, int num_threads) {
    if (tables && block_size <= 0) return -1;
    if (D % 16 || D <= 0 || D > MAX_HEAD_DIM) return -1;
    Plan p;
    /* keys and values rounded up to 16 here, the values to 32 in the plan's unit_size: its room is enough */
    const int rc = plan_work(seqs, num_seqs, H, Hkv, UNIT_D(D), QT, num_threads, &p);
    if (rc) {
        free_plan(&p);
        return rc > 0 ? 0 : rc;
    }
    /* clang-format off */
    const Call c = {(const uint16_t *)q, (const uint16_t *)k, (const uint16_t *)v, (uint16_t *)out, q_stride,
                    k_stride, v_stride, out_stride, seqs, tables, table_stride, block_size, H, Hkv, D, window,
                    scale};
    /* clang-format on */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    if (run_plan(&p, &c, QT, UNIT_D(D), pack_kv, query_tile, NULL)) {
#pragma omp atomic write
        failed = 1;
    }
    free_plan(&p);
    return failed ? -2 : 0;
}

#else /* no AVX-512 in this build: callers keep torch's SDPA */
int f32_attention_available(void) { return 0; }
int f32_attention_f32(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                      long v_stride, float *out, long out_stride, const int *seqs, int num_seqs,
                      const int *tables, int table_stride, int block_size, int H, int Hkv, int D, float scale,
                      int window, int num_threads) {
    /* clang-format off */
    (void)tables; (void)table_stride; (void)block_size;
    (void)q; (void)q_stride; (void)k; (void)k_stride; (void)v; (void)v_stride; (void)out; (void)out_stride;
    (void)seqs; (void)num_seqs; (void)H; (void)Hkv; (void)D; (void)scale; (void)window; (void)num_threads;
    /* clang-format on */
    return -3;
}
#endif
