/* Causal attention of prompt chunks in float32 with AVX-512 FMAs: the float32 counterpart of
 * bf16_attention.c, with its interface (prompt_attention.h's Call, its work plan) and its blocking.
 *
 * Why not torch's SDPA: its float32 flash kernel ran at 103-179 GFLOP/s on two cores of a Xeon with AMX at
 * 512-2048-token prompts (a third to half of the FMA units' peak) and took ~21% of a float32 prefill of
 * such prompts, one call per prompt; a chunk after cached context went through a gathered copy of its
 * keys and an explicit mask, without skipping the masked blocks. Here all of a step's prompt chunks go in
 * one call, the keys are read in place through the block tables, and only the causal blocks are computed.
 *
 * Per (sequence, KV head) the keys are packed as [16-key block][D][16 keys] (16 x 16 transposes in
 * registers) and the values as [key][D], zero past the sequence. Then per (sequence, head, tile of 16
 * query rows), over blocks of 64 keys (flash / online softmax: a block's scores and probabilities stay in
 * L1):
 *     S = Q K^T                        FMAs, lanes over 16 keys, a query row's element broadcast
 *     m' = max(m, rowmax(S * scale)),  alpha = exp(m - m')
 *     P = exp(S * scale - m')          causal / sliding-window mask; l = alpha l + sum(P)
 *     O = alpha O + P V                FMAs, lanes over 16 dims, a row's P broadcast
 * and at the end out = O / l, all in float32 (the arithmetic of torch's flash kernel in float32; the sums
 * run in another order, so results differ from SDPA's by float32 rounding).
 *
 * Query position of row i of a sequence: kv_len - q_len + i (the chunk is the last q_len positions of
 * the context); it sees keys j <= position, and with a sliding window W > 0 only j > position - W. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include "cpu_common.h" /* exp512: the softmax's exp, as in paged_attention.c */
#include "prompt_attention.h" /* Call, the 16 x 16 transpose, the work plan */
#include <omp.h>

#define QT 16 /* query rows per work item */
#define BK 64 /* keys per softmax block: S (4 KiB) and P stay in L1 */
#define RG 4  /* query rows per register block */
#define MAX_HEAD_DIM 256

int f32_attention_available(void) { return 1; }

/* The plan and the packed units count elements of 16 bits (prompt_attention.h): a float32 unit of head
 * dim D takes the room of a 16-bit one of 2 D. */
#define UNIT_D(D) (2 * (D))

/* Sequence s, KV head g: its keys into kt ([16-key block][D][16 keys], keys rounded up to 16) and its
 * values into vt ([key][D], keys rounded up to 16), zero past its length. */
static void pack_kv(const Call *c, int s, int g, Unit u) {
    float *kt = u.k, *vt = u.v;
    const int len = c->seqs[4 * s + 3], D = c->D, blocks = ceil_to(len, 16) / 16;
    const float *k = (const float *)c->k + g * D, *v = (const float *)c->v + g * D;
    for (int kb = 0; kb < blocks; kb++) {
        for (int db = 0; db < D / 16; db++) {
            __m512i r[16];
            for (int n = 0; n < 16; n++)
                r[n] = kb * 16 + n < len
                           ? _mm512_loadu_si512(k + key_row(c, s, kb * 16 + n) * c->k_stride + db * 16)
                           : _mm512_setzero_si512();
            transpose16(r); /* r[d]: dim db * 16 + d of the block's 16 keys */
            float *t = kt + ((size_t)kb * D + db * 16) * 16;
            for (int d = 0; d < 16; d++) _mm512_storeu_si512(t + d * 16, r[d]);
        }
        for (int n = 0; n < 16; n++) {
            float *dst = vt + ((size_t)kb * 16 + n) * D;
            if (kb * 16 + n < len)
                memcpy(dst, v + key_row(c, s, kb * 16 + n) * c->v_stride, sizeof(float) * D);
            else
                memset(dst, 0, sizeof(float) * D);
        }
    }
}

/* S[r][16 n + l] = Q row r . key 16 n + l of the block at kt, for RG rows (D apart) and nb <= 4 16-key
 * blocks; S rows BK apart. Inlined with nb constant, so that the RG x nb accumulators stay in registers. */
static inline __attribute__((always_inline)) void qk_block(const float *Q, int D, const float *kt, float *S,
                                                           const int nb) {
    __m512 acc[RG][4];
    for (int r = 0; r < RG; r++)
        for (int n = 0; n < nb; n++) acc[r][n] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m512 kv[4];
        for (int n = 0; n < nb; n++) {
            kv[n] = _mm512_loadu_ps(kt + ((size_t)n * D + d) * 16);
            KEEP_IN_REGISTER(kv[n]);
        }
        for (int r = 0; r < RG; r++) {
            const __m512 qb = _mm512_set1_ps(Q[r * D + d]);
            for (int n = 0; n < nb; n++) acc[r][n] = _mm512_fmadd_ps(qb, kv[n], acc[r][n]);
        }
    }
    for (int r = 0; r < RG; r++)
        for (int n = 0; n < nb; n++) _mm512_storeu_ps(S + r * BK + 16 * n, acc[r][n]);
}

/* O[r][d0 ..] = alpha[r] O[r][d0 ..] + sum over keys j < nk of P[r][j] V[j][d0 ..], `nv` <= 4 vectors of 16
 * dims, RG rows (P rows BK apart, O rows D apart). Inlined with nv constant (registers, as qk_block). */
static inline __attribute__((always_inline)) void
pv_part(const float *P, const float *vt, int D, int nk, float *O, const float *alpha, int d0, const int nv) {
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
            const __m512 pb = _mm512_set1_ps(P[r * BK + key]);
            for (int j = 0; j < nv; j++) acc[r][j] = _mm512_fmadd_ps(pb, vv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < RG; r++)
        for (int j = 0; j < nv; j++) _mm512_storeu_ps(O + r * D + d0 + 16 * j, acc[r][j]);
}
static inline void pv_block(const float *P, const float *vt, int D, int nk, float *O, const float *alpha) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        switch ((D - d0) / 16) {
        case 1: pv_part(P, vt, D, nk, O, alpha, d0, 1); break;
        case 2: pv_part(P, vt, D, nk, O, alpha, d0, 2); break;
        case 3: pv_part(P, vt, D, nk, O, alpha, d0, 3); break;
        default: pv_part(P, vt, D, nk, O, alpha, d0, 4); break;
        }
    }
}

/* Query rows QT t .. QT t + QT - 1 of sequence s, head h, over the packed keys kt / values vt of its KV
 * head. The scratch (~41 KiB at D = 256) lives on the stack: L1/L2-resident, nothing to allocate. */
static void query_tile(const Call *c, void *scratch, int s, int h, int t, Unit u) {
    (void)scratch; /* on the stack, below */
    const float *kt = u.k, *vt = u.v;
    const int D = c->D, window = c->window;
    const float scale = c->scale;
    const int q_row = c->seqs[4 * s], q_len = c->seqs[4 * s + 1], kv_len = c->seqs[4 * s + 3];
    const int r0 = QT * t, nr = q_len - r0 < QT ? q_len - r0 : QT, groups = (nr + RG - 1) / RG;
    const int pos0 = kv_len - q_len + r0, end = pos0 + nr; /* keys 0 .. end - 1 at most */
    const int first = first_key(pos0, window);
    _Alignas(64) float Q[QT * MAX_HEAD_DIM], S[QT * BK], P[QT * BK], O[QT * MAX_HEAD_DIM];
    float m[QT], l[QT], alpha[QT];
    const float *q = (const float *)c->q;
    /* the query rows, zero-padded to whole register blocks (a padding row's scores are 0, its P is 0) */
    for (int r = 0; r < groups * RG; r++) {
        if (r < nr)
            memcpy(Q + r * D, q + (long)(q_row + r0 + r) * c->q_stride + h * D, sizeof(float) * D);
        else
            memset(Q + r * D, 0, sizeof(float) * D);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(O, 0, sizeof(float) * groups * RG * D);
    for (int kb = first / 16 * 16; kb < end; kb += BK) {
        const int nb = ((end - kb < BK ? end - kb : BK) + 15) / 16;
        const float *kblk = kt + (size_t)kb * D; /* 16-key blocks of 16 * D elements */
        for (int g = 0; g < groups; g++) {
            const float *qg = Q + g * RG * D;
            float *sg = S + g * RG * BK;
            switch (nb) {
            case 4: qk_block(qg, D, kblk, sg, 4); break;
            case 3: qk_block(qg, D, kblk, sg, 3); break;
            case 2: qk_block(qg, D, kblk, sg, 2); break;
            default: qk_block(qg, D, kblk, sg, 1); break;
            }
        }
        /* online softmax: each row's running max m and sum l, its P = exp for this block (zero on masked
         * keys), alpha the factor its O is rescaled by */
        for (int r = 0; r < groups * RG; r++) {
            float *pr = P + r * BK;
            const int pos = r < nr ? pos0 + r : -1; /* a padding row sees no key: its P is zero */
            __m512 e[4];
            softmax_step(S + r * BK, nb, kb, first_key(pos, window), pos, scale, &m[r], &l[r], &alpha[r], e);
            for (int n = 0; n < nb; n++) _mm512_storeu_ps(pr + 16 * n, e[n]);
        }
        for (int g = 0; g < groups; g++)
            pv_block(P + g * RG * BK, vt + (size_t)kb * D, D, 16 * nb, O + g * RG * D, alpha + g * RG);
    }
    float *out = (float *)c->out;
    for (int r = 0; r < nr; r++) {
        float *o = out + (long)(q_row + r0 + r) * c->out_stride + h * D;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
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
    /* values rounded up to 32 keys in the plan's unit_size, 16 here: the plan's room is enough */
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
