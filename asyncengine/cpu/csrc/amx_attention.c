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
 * block][16 key pairs][16 dims][2]. Then per (sequence, head, tile of 16 query rows), key block by key
 * block (KEY_BLOCK keys; flash attention's online softmax):
 *     S = Q K^T over the block's keys the rows may see   (float32 accumulators, exact bf16 products)
 *     m' = max(m, rowmax(S) * scale), alpha = exp(m - m')  (the running maximum)
 *     P = exp(S * scale - m')                             (float32; causal / sliding-window mask)
 *     sum = sum * alpha + rowsum(P), O = O * alpha + bf16(P) V   (float32; O kept between blocks)
 * and out = bf16(O / sum) at the end: the arithmetic of torch's flash kernel for bfloat16 inputs (P rounded
 * to bfloat16 for the second product, the sums in float32). The block's scores and probabilities stay in
 * L1 (a whole row of scores, a few thousand keys for 16 rows, lived in L2 before and cost ~2x), and the
 * exponentials are 2^x with the scale and log2(e) folded into one multiply.
 *
 * Query position of row i of a sequence: kv_len - q_len + i (the chunk is the last q_len positions of
 * the context); it sees keys j <= position, and with a sliding window W > 0 only j > position - W. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include "amx_common.h" /* request_tiles, configure_tiles, TILE */
#include "cpu_common.h" /* exp2h_512: the softmax's exponentials */
#include "prompt_attention.h" /* Call, the work plan; transpose16 (cpu_common.h) */
#include <omp.h>

#define MAX_HEAD_DIM 256

static inline int min_int(int a, int b) { return a < b ? a : b; }

int amx_attention_available(void) { return request_tiles(); }

/* Sequence s, KV head g: its keys and values into B tiles kt / vt, zero past its length. */
static void pack_kv(const Call *c, int s, int g, Unit u) {
    uint16_t *kt = u.k, *vt = u.v;
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


/* The maximum of a block's scores sr (keys b0 .. b1 - 1) over the keys lo .. pos; `full` when the row
 * sees every key of the block (no masks: constant at each call, so each case compiles on its own). */
static inline float row_max(const float *sr, int b0, int b1, int lo, int pos, int full) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int j = b0; j < b1; j += 16) {
        const __m512 x = _mm512_loadu_ps(sr + j - b0);
        mx = full ? _mm512_max_ps(mx, x) : _mm512_mask_max_ps(mx, valid_keys(j, lo, pos), mx, x);
    }
    return _mm512_reduce_max_ps(mx);
}

/* pr = bf16(2^(sr c2 - m)) over the block, zero past the keys lo .. pos; returns the float32 sum. */
static inline float row_exp(const float *sr, uint16_t *pr, int b0, int b1, int lo, int pos, __m512 c2v,
                            __m512 m, int full) {
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    const __m512 mh = _mm512_sub_ps(m, _mm512_set1_ps(0.5f)); /* exp2h_512 takes 2^(y - 1/2) */
    for (int j = b0; j < b1; j += 32) { /* 32 keys: one 64-byte row of P */
        const __mmask16 k0 = full ? 0xFFFF : valid_keys(j, lo, pos),
                        k1 = full ? 0xFFFF : valid_keys(j + 16, lo, pos);
        if (!full && !(k0 | k1)) {
            _mm512_storeu_si512(pr + j - b0, _mm512_setzero_si512());
            continue;
        }
        __m512 e0 = exp2h_512(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j - b0), c2v, mh));
        __m512 e1 = exp2h_512(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j + 16 - b0), c2v, mh));
        if (!full) {
            e0 = _mm512_maskz_mov_ps(k0, e0);
            e1 = _mm512_maskz_mov_ps(k1, e1);
        }
        sum0 = _mm512_add_ps(sum0, e0);
        sum1 = _mm512_add_ps(sum1, e1);
        _mm512_storeu_si512(pr + j - b0, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

/* Query rows per work item: two 16-row A tiles, so that every K and V tile loaded (1 KiB, from L2) feeds two
 * products instead of one (~5% faster than 16 rows at 256-2048-token prompts). */
#define QT 32

/* Keys per softmax block. Two blocks' scores (2 x 16 KiB) and probabilities (2 x 8 KiB) stay near L1: the
 * products of the blocks before and after run on the tiles while the block between them is softmaxed. */
#define KEY_BLOCK 128

/* Per-thread scratch of a call: two key blocks' scores and probabilities, the query rows' float32 output
 * accumulators (kept between key blocks), a zero-padded query tile. */
typedef struct {
    float *S, *O;
    uint16_t *P, *Q;
} Scratch;

/* Tiles (configure_tiles(16)): the scores use accumulators 0, 1 (query rows 0-15, 16-31) and B tile 6, the
 * output accumulators 2, 3 and B tile 7; both load their A tiles (Q or P) into 4 and 5 at each step. The
 * products are cut into steps that the softmax loop issues between its rows, so that the tiles work while
 * the vector units compute exponentials (one after the other, as before, the products and the softmax
 * each took about half of a 2,048-key query tile's time). */

/* S = Q K^T for the 16-key blocks kb0 .. kb1 - 1 of one key block, one at a time. */
typedef struct {
    const uint16_t *q, *kt;
    float *S;
    long q_stride;
    int DB32, halves, kb0, kb1, next;
} ScoreWork;

/* The scores of the key block from key k0 (a multiple of 32) into S: its 16-key blocks below kend16 (past it
 * every key is masked, so none are computed; none at all from kend16 on). */
static inline ScoreWork score_work(const uint16_t *q, long q_stride, const uint16_t *kt, float *S, int D,
                                   int halves, int k0, int kend16) {
    const int k1 = k0 < kend16 ? min_int(k0 + KEY_BLOCK, kend16) : k0;
    return (ScoreWork){q, kt, S, q_stride, D / 32, halves, k0 / 16, k1 / 16, k0 / 16};
}

static inline void score_step(ScoreWork *w) {
    const int kb = w->next++;
    _tile_zero(0);
    if (w->halves > 1) _tile_zero(1);
    for (int db = 0; db < w->DB32; db++) {
        _tile_loadd(6, w->kt + ((size_t)kb * w->DB32 + db) * TILE, 64);
        _tile_loadd(4, w->q + db * 32, w->q_stride * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (w->halves > 1) {
            _tile_loadd(5, w->q + 16 * w->q_stride + db * 32, w->q_stride * 2);
            _tile_dpbf16ps(1, 5, 6);
        }
    }
    float *S = w->S + (kb - w->kb0) * 16;
    _tile_stored(0, S, KEY_BLOCK * 4);
    if (w->halves > 1) _tile_stored(1, S + 16 * KEY_BLOCK, KEY_BLOCK * 4);
}

/* O (+)= P V for one key block (32-key chunks c0 .. c0 + chunks - 1 of V), one (16-dim block, chunk) at a
 * time; `first`: the accumulators start at zero instead of from O. */
typedef struct {
    const uint16_t *P, *vt;
    float *O;
    int D, halves, c0, chunks, first, next, total;
} OutputWork;

static inline void output_step(OutputWork *w) {
    const int u = w->next++, d = u / w->chunks, c = u % w->chunks, two = w->halves > 1;
    float *o = w->O + d * 16;
    if (c == 0) {
        if (w->first) {
            _tile_zero(2);
            if (two) _tile_zero(3);
        } else {
            _tile_loadd(2, o, w->D * 4);
            if (two) _tile_loadd(3, o + 16 * w->D, w->D * 4);
        }
    }
    _tile_loadd(7, w->vt + ((size_t)(w->c0 + c) * (w->D / 16) + d) * TILE, 64);
    _tile_loadd(4, w->P + c * 32, KEY_BLOCK * 2);
    _tile_dpbf16ps(2, 4, 7);
    if (two) {
        _tile_loadd(5, w->P + 16 * KEY_BLOCK + c * 32, KEY_BLOCK * 2);
        _tile_dpbf16ps(3, 5, 7);
    }
    if (c == w->chunks - 1) {
        _tile_stored(2, o, w->D * 4);
        if (two) _tile_stored(3, o + 16 * w->D, w->D * 4);
    }
}

/* The steps of both due once `done` of `rows` rows are softmaxed (all of them at done == rows). */
static inline void tile_steps(ScoreWork *sw, OutputWork *ow, int done, int rows) {
    while (sw->next < sw->kb1 && (sw->next - sw->kb0) * rows < done * (sw->kb1 - sw->kb0)) score_step(sw);
    while (ow->next < ow->total && ow->next * rows < done * ow->total) output_step(ow);
}

/* O rows r < nr times alpha[r] where it is not 1. */
static inline void scale_rows(float *O, int D, int nr, const float *alpha) {
    for (int r = 0; r < nr; r++)
        if (alpha[r] != 1.0f) {
            const __m512 a = _mm512_set1_ps(alpha[r]);
            for (int d = 0; d < D; d += 16)
                _mm512_storeu_ps(O + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(O + r * D + d), a));
        }
}

/* Query rows QT t .. QT t + QT - 1 of sequence s, head h, over K / V tiles kt / vt of its KV head. */
static void query_tile(const Call *c, void *scratch, int s, int h, int t, Unit u) {
    const Scratch *w = scratch;
    const uint16_t *kt = u.k, *vt = u.v;
    const int D = c->D, window = c->window;
    /* exp(x * scale - max) = 2^(x * c2 - max * c2): the scale and the change of base in one multiply */
    const __m512 c2v = _mm512_set1_ps(c->scale * 1.44269504088896341f);
    float *O = w->O;
    const int q_row = c->seqs[4 * s], q_len = c->seqs[4 * s + 1], kv_len = c->seqs[4 * s + 3];
    const int r0 = QT * t, nr = q_len - r0 < QT ? q_len - r0 : QT, halves = (nr + 15) / 16,
              rows = 16 * halves;
    const int pos0 = kv_len - q_len + r0, end = pos0 + nr; /* keys 0 .. end - 1 at most */
    const int first = first_key(pos0, window);
    const int ka = first / 32 * 32, kend16 = ceil_to(end, 16), kend32 = ceil_to(end, 32);
    /* the query rows: in place, or zero-padded to whole 16-row tiles */
    const uint16_t *qa = c->q + (long)(q_row + r0) * c->q_stride + h * D;
    long qs = c->q_stride;
    if (nr < rows) {
        memset(w->Q, 0, sizeof(uint16_t) * rows * D);
        for (int r = 0; r < nr; r++) memcpy(w->Q + r * D, qa + (long)r * qs, sizeof(uint16_t) * D);
        qa = w->Q;
        qs = D;
    }
    /* per row: the running maximum (times c2) and sum of the exponentials (float32); alpha of the block
     * before, due on O once that block's P V is in */
    float m[QT], l[QT], alpha[QT], alpha_prev[QT];
    for (int r = 0; r < QT; r++) m[r] = -INFINITY, l[r] = 0.0f;
    int moved_prev = 0;
    ScoreWork sw = score_work(qa, qs, kt, w->S, D, halves, ka, kend16);
    while (sw.next < sw.kb1) score_step(&sw); /* the first block's scores, before anything overlaps */
    OutputWork ow = {0};
    for (int i = 0, b0 = ka; b0 < kend32; i++, b0 += KEY_BLOCK) {
        const int b1 = kend32 - b0 < KEY_BLOCK ? kend32 : b0 + KEY_BLOCK;
        float *S = w->S + (i & 1) * QT * KEY_BLOCK;
        uint16_t *P = w->P + (i & 1) * QT * KEY_BLOCK;
        /* the next block's scores, into the other buffer */
        sw = score_work(qa, qs, kt, w->S + ((i + 1) & 1) * QT * KEY_BLOCK, D, halves, b1, kend16);
        /* the block before's P V goes on O scaled by that block's alpha, the one before it being in */
        if (moved_prev) scale_rows(O, D, nr, alpha_prev);
        float bm[QT];
        for (int r = 0; r < rows; r++) {
            const int pos = pos0 + r, lo = first_key(pos, window);
            bm[r] = r >= nr                     ? -INFINITY
                    : lo <= b0 && pos >= b1 - 1 ? row_max(S + r * KEY_BLOCK, b0, b1, lo, pos, 1)
                                                : row_max(S + r * KEY_BLOCK, b0, b1, lo, pos, 0);
        }
        /* the rows' new maxima and alpha, 16 at once (a row with no key so far has sum and output 0) */
        int moved = 0;
        for (int r = 0; r < rows; r += 16) {
            const __m512 m_old = _mm512_loadu_ps(m + r);
            const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(_mm512_loadu_ps(bm + r), c2v));
            const __mmask16 mv = _mm512_cmp_ps_mask(m_old, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ)
                                 & _mm512_cmp_ps_mask(m_new, m_old, _CMP_NEQ_OQ);
            const __m512 a = exp2h_512(_mm512_add_ps(_mm512_sub_ps(m_old, m_new), _mm512_set1_ps(0.5f)));
            _mm512_storeu_ps(alpha + r, _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), mv, a));
            _mm512_storeu_ps(m + r, m_new);
            moved |= mv != 0;
        }
        for (int r = 0; r < rows; r++) {
            uint16_t *pr = P + (long)r * KEY_BLOCK;
            if (bm[r] == -INFINITY) { /* no key of this block for the row */
                memset(pr, 0, sizeof(uint16_t) * (b1 - b0));
            } else {
                const int pos = pos0 + r, lo = first_key(pos, window);
                const __m512 mv = _mm512_set1_ps(m[r]);
                const float sum = lo <= b0 && pos >= b1 - 1
                                      ? row_exp(S + r * KEY_BLOCK, pr, b0, b1, lo, pos, c2v, mv, 1)
                                      : row_exp(S + r * KEY_BLOCK, pr, b0, b1, lo, pos, c2v, mv, 0);
                l[r] = l[r] * alpha[r] + sum;
            }
            tile_steps(&sw, &ow, r + 1, rows);
        }
        memcpy(alpha_prev, alpha, sizeof alpha);
        moved_prev = moved;
        ow = (OutputWork){
            P, vt, O, D, halves, b0 / 32, (b1 - b0) / 32, b0 == ka, 0, D / 16 * ((b1 - b0) / 32)};
    }
    if (moved_prev) scale_rows(O, D, nr, alpha_prev);
    while (ow.next < ow.total) output_step(&ow); /* the last block's P V */
    /* out = bf16(O / sum), rounded as torch rounds (bf16_pack keeps denormals) */
    for (int r = 0; r < nr; r++) {
        uint16_t *o = c->out + (long)(q_row + r0 + r) * c->out_stride + h * D;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(o + d), bf16_pack(_mm512_mul_ps(_mm512_loadu_ps(O + r * D + d), inv)));
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
    {
        Scratch w = {NULL, NULL, NULL, NULL};
        w.S = aligned_alloc(64, sizeof(float) * 2 * QT * KEY_BLOCK);
        w.P = aligned_alloc(64, sizeof(uint16_t) * 2 * QT * KEY_BLOCK);
        w.O = aligned_alloc(64, sizeof(float) * QT * MAX_HEAD_DIM);
        w.Q = aligned_alloc(64, sizeof(uint16_t) * QT * MAX_HEAD_DIM);
        if (!w.S || !w.P || !w.O || !w.Q) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            configure_tiles(16);
            if (run_plan(&p, &c, QT, D, pack_kv, query_tile, &w)) {
#pragma omp atomic write
                failed = 1;
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
