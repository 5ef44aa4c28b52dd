/* Causal attention of prompt chunks on Intel AMX (bfloat16): the prefill counterpart of paged_attention.c.
 *
 * Why not torch's SDPA (the CPU flash kernel): a prefill step holds many short prompts (the bench's mixed
 * workload: 16-256 tokens), one SDPA call each, and at those lengths SDPA reaches 90-170 GFLOP/s on this
 * machine's two cores: it was 23% of a prefill-only run of that workload, 29% with the per-call work
 * around it. Here all of a step's prompts go in one call and one OpenMP region, and both products run
 * on AMX tiles.
 *
 * Per (sequence, KV head) the keys and values are first packed into AMX B tiles (zero past the
 * sequence): K as [16-key block][32-dim block][16 dim pairs][16 keys][2], V as [32-key block][16-dim
 * block][16 key pairs][16 dims][2]. Then per (sequence, head, tile of 16 query rows):
 *     S = Q K^T over the keys the rows may see      (float32 accumulators, exact bf16 products)
 *     P = exp(S * scale - rowmax)                   (float32; causal / sliding-window mask)
 *     O = bf16(P) V / sum(P)                        (float32 accumulators, one rounding to bf16 at the end)
 * which is the arithmetic of torch's flash kernel for bfloat16 inputs (P rounded to bfloat16 for the
 * second product, the row sums kept in float32), without its key blocking: one softmax over all of a
 * row's keys, held in a float32 scratch row (the rows are prompt chunks, at most a few thousand keys).
 *
 * Query position of row i of a sequence: kv_len - q_len + i (the chunk is the last q_len positions of
 * the context); it sees keys j <= position, and with a sliding window W > 0 only j > position - W. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include "amx_common.h" /* request_tiles, configure_tiles, TILE */
#include "cpu_common.h" /* exp512: the softmax's exp, as in paged_attention.c */
#include "prompt_attention.h" /* Call, the K transpose, the work plan */
#include <omp.h>

#define MAX_HEAD_DIM 256

int amx_attention_available(void) { return request_tiles(); }

/* Tiles (configure_tiles(16)): 0-3 float32 accumulators, 4 the A operand (Q or P), 6 and 7 B tiles. */

/* Sequence s, KV head g: its keys and values into B tiles kt / vt, zero past its length. */
static void pack_kv(const Call *c, int s, int g, uint16_t *kt, uint16_t *vt) {
    const int len = c->seqs[4 * s + 3], D = c->D;
    const uint16_t *k = c->k + g * D, *v = c->v + g * D;
    const int DB32 = D / 32, DB16 = D / 16;
    /* K tile (16 keys x 32 dims): 32-bit word [p][n] = dims 2p, 2p + 1 of key n, the 16 keys' rows
     * transposed */
    for (int kb = 0; kb < ceil_to(len, 16) / 16; kb++)
        for (int db = 0; db < DB32; db++) {
            __m512i r[16];
            for (int n = 0; n < 16; n++)
                r[n] = kb * 16 + n < len
                           ? _mm512_loadu_si512(k + key_row(c, s, kb * 16 + n) * c->k_stride + db * 32)
                           : _mm512_setzero_si512();
            transpose16(r);
            uint16_t *t = kt + ((size_t)kb * DB32 + db) * TILE;
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(t + p * 32, r[p]);
        }
    /* V tile (32 keys x 16 dims): row p = keys 2p and 2p + 1 interleaved dim by dim */
    /* clang-format off */
    const __m512i inter = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                           39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    /* clang-format on */
    for (int kb = 0; kb < ceil_to(len, 32) / 32; kb++)
        for (int db = 0; db < DB16; db++) {
            uint16_t *t = vt + ((size_t)kb * DB16 + db) * TILE;
            for (int p = 0; p < 16; p++) {
                const int k0 = kb * 32 + 2 * p;
                const __m512i a = k0 < len
                                      ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                            (const __m256i *)(v + key_row(c, s, k0) * c->v_stride + db * 16)))
                                      : _mm512_setzero_si512();
                const __m512i b =
                    k0 + 1 < len ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                       (const __m256i *)(v + key_row(c, s, k0 + 1) * c->v_stride + db * 16)))
                                 : _mm512_setzero_si512();
                _mm512_storeu_si512(t + p * 32, _mm512_permutex2var_epi16(a, inter, b));
            }
        }
}


/* Accumulators j < n (tiles 0-3) += A tile 4 times the B tiles b + j * step (B in tiles 6 and 7 by turns). */
static inline void products(const uint16_t *b, size_t step, int n) {
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    /* clang-format off */
    if (n > 1) { _tile_loadd(7, b + step, 64); _tile_dpbf16ps(1, 4, 7); }
    if (n > 2) { _tile_loadd(6, b + 2 * step, 64); _tile_dpbf16ps(2, 4, 6); }
    if (n > 3) { _tile_loadd(7, b + 3 * step, 64); _tile_dpbf16ps(3, 4, 7); }
    /* clang-format on */
}

/* Accumulators j < n to dst + j * step floats, rows `stride` bytes apart. */
static inline void store_accs(float *dst, size_t step, long stride, int n) {
    _tile_stored(0, dst, stride);
    if (n > 1) _tile_stored(1, dst + step, stride);
    if (n > 2) _tile_stored(2, dst + 2 * step, stride);
    if (n > 3) _tile_stored(3, dst + 3 * step, stride);
}

/* Per-thread scratch of a call: scores, probabilities, output tiles, a zero-padded query tile. */
typedef struct {
    float *S, *O;
    uint16_t *P, *Q;
} Scratch;

/* Query rows 16 t .. 16 t + 15 of sequence s, head h, over K / V tiles kt / vt of its KV head. */
static void query_tile(const Call *c, const Scratch *w, int s, int h, int t, const uint16_t *kt,
                       const uint16_t *vt) {
    const int D = c->D, DB32 = D / 32, DB16 = D / 16, ld = c->ld, window = c->window;
    const float scale = c->scale;
    float *S = w->S, *O = w->O;
    uint16_t *P = w->P, *Q = w->Q;
    const int q_row = c->seqs[4 * s], q_len = c->seqs[4 * s + 1], kv_len = c->seqs[4 * s + 3];
    const int r0 = 16 * t, nr = q_len - r0 < 16 ? q_len - r0 : 16;
    const int pos0 = kv_len - q_len + r0, end = pos0 + nr; /* keys 0 .. end - 1 at most */
    const int first = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
    const int ka = first / 32 * 32, kend16 = ceil_to(end, 16), kend32 = ceil_to(end, 32);
    const long q_stride = c->q_stride, out_stride = c->out_stride;
    const uint16_t *q = c->q;
    uint16_t *out = c->out;
    /* the tile of queries: in place, or zero-padded when fewer than 16 rows are left */
    const uint16_t *qa = q + (long)(q_row + r0) * q_stride + h * D;
    long qs = q_stride;
    if (nr < 16) {
        memset(Q, 0, sizeof(uint16_t) * 16 * D);
        for (int r = 0; r < nr; r++) memcpy(Q + r * D, qa + (long)r * q_stride, sizeof(uint16_t) * D);
        qa = Q;
        qs = D;
    }
    /* S[:, ka .. kend16) = Q K^T, four key blocks at a time */
    for (int kb = ka / 16; kb < kend16 / 16; kb += 4) {
        const int nb = kend16 / 16 - kb < 4 ? kend16 / 16 - kb : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int db = 0; db < DB32; db++) {
            _tile_loadd(4, qa + db * 32, qs * 2);
            products(kt + ((size_t)kb * DB32 + db) * TILE, (size_t)DB32 * TILE, nb);
        }
        store_accs(S + (kb * 16 - ka), 16, ld * 4, nb);
    }
    /* softmax of each row over the keys it sees; P = bf16(exp), zero elsewhere (and on padding rows) */
    float inv_sum[16];
    for (int r = 0; r < 16; r++) {
        uint16_t *pr = P + (long)r * ld;
        if (r >= nr) {
            memset(pr, 0, sizeof(uint16_t) * (kend32 - ka));
            continue;
        }
        const int pos = pos0 + r, lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        const float *sr = S + (long)r * ld;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int j = ka; j < kend32; j += 16) {
            const __mmask16 mk = valid_keys(j, lo, pos);
            mx = _mm512_max_ps(mx, _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), mk,
                                                      _mm512_maskz_loadu_ps(mk, sr + j - ka),
                                                      _mm512_set1_ps(scale)));
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int j = ka; j < kend32; j += 16) {
            const __mmask16 mk = valid_keys(j, lo, pos);
            if (!mk) {
                _mm256_storeu_si256((__m256i *)(pr + j - ka), _mm256_setzero_si256());
                continue;
            }
            const __m512 e = _mm512_maskz_mov_ps(
                mk, exp512(_mm512_sub_ps(
                        _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, sr + j - ka), _mm512_set1_ps(scale)), m)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(pr + j - ka), (__m256i)_mm512_cvtneps_pbh(e));
        }
        inv_sum[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* O = P V, four 16-dim blocks at a time; out = bf16(O / sum) */
    for (int d0 = 0; d0 < DB16; d0 += 4) {
        const int nd = DB16 - d0 < 4 ? DB16 - d0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kb = ka / 32; kb < kend32 / 32; kb++) {
            _tile_loadd(4, P + (kb * 32 - ka), ld * 2);
            products(vt + ((size_t)kb * DB16 + d0) * TILE, TILE, nd);
        }
        store_accs(O, 256, 64, nd);
        for (int r = 0; r < nr; r++) {
            uint16_t *o = out + (long)(q_row + r0 + r) * out_stride + h * D + d0 * 16;
            const __m512 inv = _mm512_set1_ps(inv_sum[r]);
            for (int j = 0; j < nd; j++)
                _mm256_storeu_si256(
                    (__m256i *)(o + 16 * j),
                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(O + 256 * j + 16 * r), inv)));
        }
    }
}

/* seqs: [num_seqs][4] = first query row, query rows, first key row, key rows (rows of q/out and of k/v).
 * q, out [rows, H * D], k, v [rows, Hkv * D], each with its row stride in elements.
 * tables (or NULL): the keys are read in place from a paged cache, k / v its [blocks * block_size,
 * Hkv * D] rows; a sequence's third field is then the row of `tables` that holds its block table.
 * Returns 0; -1 for an unsupported shape (D not a multiple of 32 or over MAX_HEAD_DIM, H not a multiple
 * of Hkv, more query than key rows); -2 when scratch cannot be allocated. The work split is
 * prompt_attention.h's plan_work. */
int amx_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k, long k_stride, const uint16_t *v,
                       long v_stride, uint16_t *out, long out_stride, const int *seqs, int num_seqs,
                       const int *tables, int table_stride, int block_size, int H, int Hkv, int D,
                       float scale, int window, int num_threads) {
    if (tables && block_size <= 0) return -1;
    if (D % 32 || D <= 0 || D > MAX_HEAD_DIM) return -1;
    Plan p;
    const int rc = plan_work(seqs, num_seqs, H, Hkv, D, 16, num_threads, &p);
    if (rc) {
        free_plan(&p);
        return rc > 0 ? 0 : rc;
    }
    /* clang-format off */
    const Call c = {q, k, v, out, q_stride, k_stride, v_stride, out_stride, seqs, tables, table_stride,
                    block_size, H, Hkv, D, window, ceil_to(p.max_kv, 32) + 32, scale};
    /* clang-format on */
    const int group = H / Hkv;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch w = {NULL, NULL, NULL, NULL};
        w.S = aligned_alloc(64, sizeof(float) * 16 * c.ld);
        w.P = aligned_alloc(64, sizeof(uint16_t) * 16 * c.ld);
        w.O = aligned_alloc(64, sizeof(float) * 4 * 256);
        w.Q = aligned_alloc(64, sizeof(uint16_t) * 16 * MAX_HEAD_DIM);
        if (!w.S || !w.P || !w.O || !w.Q) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            configure_tiles(16);
            if (p.fused) {
#pragma omp for schedule(dynamic, 1)
                for (long i = 0; i < p.n_work; i++) {
                    const int s = p.work[i].index / Hkv, g = p.work[i].index % Hkv, tiles = (seqs[4 * s + 1] + 15) / 16;
                    const UnitTiles u = unit_tiles(p.kv, p.base, seqs, s, g, D);
                    pack_kv(&c, s, g, u.k, u.v);
                    for (int h = g * group; h < (g + 1) * group; h++)
                        for (int t = tiles - 1; t >= 0; t--) query_tile(&c, &w, s, h, t, u.k, u.v);
                }
            } else {
#pragma omp for schedule(dynamic, 1)
                for (int i = 0; i < p.units; i++) {
                    const UnitTiles u = unit_tiles(p.kv, p.base, seqs, i / Hkv, i % Hkv, D);
                    pack_kv(&c, i / Hkv, i % Hkv, u.k, u.v);
                }
#pragma omp for schedule(dynamic, 1)
                for (long i = 0; i < p.n_work; i++) {
                    int s, t, h;
                    unfused_item(&p.work[i], seqs, H, 16, &s, &t, &h);
                    const UnitTiles u = unit_tiles(p.kv, p.base, seqs, s, h / group, D);
                    query_tile(&c, &w, s, h, t, u.k, u.v);
                }
            }
            _tile_release();
        }
        free(w.S);
        free(w.P);
        free(w.O);
        free(w.Q);
    }
    free_plan(&p);
    return failed ? -2 : 0;
}

#else /* no AMX in this build: callers keep torch's SDPA */
int amx_attention_available(void) { return 0; }
int amx_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k, long k_stride, const uint16_t *v,
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
