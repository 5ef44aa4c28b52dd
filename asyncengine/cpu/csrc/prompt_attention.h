/* What the prompt-attention kernels (amx_attention.c on AMX tiles, bf16_attention.c on AVX512-BF16,
 * f32_attention.c in float32) share: their call's arguments, the key masks, where a (sequence, KV head)'s
 * packed K / V live, the work plan (validation, the packing buffers, the costliest-first list of work
 * items) and its run, and (the two without AMX) the online softmax's step over a tile's 16 rows,
 * DEFINE_SOFTMAX_ROWS. Each kernel packs and multiplies its own way. Included only where the build has AVX-512; cpu/build.py
 * hashes this file into every library's cache key. */
#ifndef ASYNCENGINE_PROMPT_ATTENTION_H
#define ASYNCENGINE_PROMPT_ATTENTION_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h" /* exp512; transpose16: K for the tiles, a query tile's rows for the others */

static inline int ceil_to(int n, int m) { return (n + m - 1) / m * m; }

/* The first key a query at position pos sees: 0, or with a sliding window W > 0, pos - W + 1. */
static inline int first_key(int pos, int window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* Lanes l of keys j .. j + 15 with lo <= j + l <= pos. */
static inline __mmask16 valid_keys(int j, int lo, int pos) {
    const int a = lo - j > 0 ? lo - j : 0, b = pos - j + 1 < 16 ? pos - j + 1 : 16;
    if (b <= a) return 0;
    return (__mmask16)((((1u << b) - 1) >> a) << a);
}

/* Keys ahead whose K / V rows the non-AMX kernels' pack_kv prefetches: it reads them from the cache in
 * place (a row per key and KV head, 128 bytes at D = 64 in bfloat16, a whole token's heads apart), written
 * by the step's KV write and often in L3 or DRAM by now. A bfloat16 step of the sweep's 16-1024-token
 * prompts with its cache out of L3: 18.8 ms a layer at 8 keys ahead, 17.5-17.6 at 32 and 64 (AMD Zen 5,
 * 2 threads). */
#define PACK_AHEAD 32

/* One call's arguments, shared by its work items. */
typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    long q_stride, k_stride, v_stride, out_stride;
    /* [num_seqs][4]: first query row, query rows, first key row (or block-table row), key rows */
    const int *seqs;
    /* NULL, or block tables [.][table_stride]: key j at row table[j / block_size] * block_size +
     * j % block_size */
    const int *tables;
    int table_stride, block_size;
    int H, Hkv, D, window;
    float scale;
} Call;

/* The row of k / v that holds key j of sequence s. */
static inline long key_row(const Call *c, int s, int j) {
    if (!c->tables) return (long)c->seqs[4 * s + 2] + j;
    const int *table = c->tables + (long)c->seqs[4 * s + 2] * c->table_stride;
    return (long)table[j / c->block_size] * c->block_size + j % c->block_size;
}

/* A (sequence, KV head)'s packed keys (rounded up to 16) and values (rounded up to 32), in 16-bit elements
 * for a head of D of them (a float32 kernel counts its head as 2 D: unit_d below). */
static inline size_t unit_size(int len, int D) { return (size_t)(ceil_to(len, 16) + ceil_to(len, 32)) * D; }

typedef struct {
    long cost;
    int index;
} Ranked;
static int by_cost_desc(const void *a, const void *b) {
    const long x = ((const Ranked *)a)->cost, y = ((const Ranked *)b)->cost;
    return x < y ? 1 : x > y ? -1 : ((const Ranked *)a)->index - ((const Ranked *)b)->index;
}

/* A call's work: with at least 4 (sequence, KV head) units per thread (`fused`) a thread takes a unit,
 * packs its K / V and runs all of its query tiles while those are in L2 (largest units first); with fewer
 * (one long prompt, few KV heads) every unit is packed first and the (head, query tile) items are shared
 * out, costliest first. */
typedef struct {
    uint16_t *kv; /* unfused: the packed K / V of every unit (the calling thread's buffer, kept between calls) */
    size_t unit_max; /* fused: the largest unit, in 16-bit elements (each thread packs into a buffer of its own) */
    size_t *base; /* unfused: [num_seqs + 1], where each sequence's units start in kv */
    Ranked *work; /* units (fused) or (query tile, head) items, costliest first */
    long n_work;
    int fused, units;
} Plan;

/* The calling thread's buffer of at least `elems` 16-bit elements, kept between calls (a fresh multi-MiB
 * buffer per layer would be page-faulted in every time); NULL when memory is short. */
static inline uint16_t *thread_buffer(size_t elems) {
    static __thread uint16_t *buf;
    static __thread size_t cap; /* bytes */
    if (elems * 2 > cap) {
        free(buf);
        cap = (elems * 2 * 5 / 4 + 63) / 64 * 64; /* headroom: the next step's prompts may be longer */
        buf = aligned_alloc(64, cap);
        if (!buf) cap = 0;
    }
    return buf;
}

/* The plan for a call with query tiles of `qt` rows: 0, 1 when there is nothing to do, -1 for an
 * unsupported shape (more query than key rows, H not a multiple of Hkv), -2 when memory is short. */
static int plan_work(const int *seqs, int num_seqs, int H, int Hkv, int D, int qt, int num_threads, Plan *p) {
    *p = (Plan){0};
    if (Hkv <= 0 || H % Hkv || num_seqs < 0) return -1;
    size_t packed = 0, items = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = seqs[4 * s + 1], kv_len = seqs[4 * s + 3];
        if (q_len < 0 || q_len > kv_len) return -1;
        packed += Hkv * unit_size(kv_len, D);
        if (unit_size(kv_len, D) > p->unit_max) p->unit_max = unit_size(kv_len, D);
        items += (size_t)H * ((q_len + qt - 1) / qt);
    }
    if (!items) return 1;
    p->units = num_seqs * Hkv;
    p->fused = p->units >= 4 * num_threads;
    if (!p->fused) {
        p->kv = thread_buffer(packed);
        if (!p->kv) return -2;
    }
    p->n_work = p->fused ? p->units : (long)items;
    p->work = malloc(sizeof(Ranked) * p->n_work);
    if (!p->work) return -2;
    if (!p->fused) { /* where each sequence's units start in the shared buffer */
        p->base = malloc(sizeof(size_t) * (num_seqs + 1));
        if (!p->base) return -2;
        p->base[0] = 0;
        for (int s = 0; s < num_seqs; s++) p->base[s + 1] = p->base[s] + Hkv * unit_size(seqs[4 * s + 3], D);
    }
    /* the costliest first, for the dynamic schedule: a unit's cost grows with q_len * kv_len, a query tile's
     * with its last key */
    long n = 0, tiles_before = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = seqs[4 * s + 1], kv_len = seqs[4 * s + 3], tiles = (q_len + qt - 1) / qt;
        if (p->fused) {
            for (int g = 0; g < Hkv; g++) p->work[n++] = (Ranked){(long)q_len * kv_len, s * Hkv + g};
        } else {
            for (int t = 0; t < tiles; t++)
                for (int h = 0; h < H; h++)
                    p->work[n++] =
                        (Ranked){kv_len - q_len + (long)qt * t + qt, (int)((tiles_before + t) * H + h)};
        }
        tiles_before += tiles;
    }
    qsort(p->work, p->n_work, sizeof(Ranked), by_cost_desc);
    return 0;
}

static void free_plan(Plan *p) {
    free(p->base);
    free(p->work);
}

/* Sequence s, KV head g's packed keys and values in the plan's buffer (unit_d: the head's 16-bit
 * elements, D, or 2 D in float32), as the kernel's pack and query functions take them. */
typedef struct { void *k, *v; } Unit;
static inline Unit plan_unit(const Plan *p, const int *seqs, int s, int g, int unit_d) {
    const int len = seqs[4 * s + 3];
    uint16_t *k = p->kv + p->base[s] + (size_t)g * unit_size(len, unit_d);
    return (Unit){k, k + (size_t)ceil_to(len, 16) * unit_d};
}

/* A kernel's two halves: pack a unit's K / V; attend one query tile t (rows qt t ..) of sequence s, head h,
 * with the calling thread's scratch. */
typedef void (*PackUnit)(const Call *c, int s, int g, Unit u);
typedef void (*QueryTile)(const Call *c, void *scratch, int s, int h, int t, Unit u);

/* An unfused item's (sequence, query tile, head): index = (tiles of the earlier sequences + t) * H + h;
 * sequences are few there (fewer than 4 units per thread), so s is found by a walk. */
static inline void unfused_item(const Ranked *item, const int *seqs, int H, int qt, int *s, int *t, int *h) {
    int seq = 0, tile = item->index / H;
    while (tile >= (seqs[4 * seq + 1] + qt - 1) / qt) tile -= (seqs[4 * seq + 1] + qt - 1) / qt, seq++;
    *s = seq, *t = tile, *h = item->index % H;
}

/* The plan's work, shared out to the threads of the enclosing parallel region (each of them calls this,
 * with its scratch): fused, a thread takes a unit, packs it into its own buffer and runs all its query
 * tiles, last tile first (the longest rows); otherwise every unit is packed, then the (query tile, head)
 * items are shared out. Returns 0, or -2 where the thread's buffer could not be allocated (its units are
 * then left undone: the call fails). Fused, the buffer is one unit's, reused unit after unit, so that the
 * packing writes lines already in L2: packing into a call-sized buffer (all units at once, 2 x the K / V)
 * fetched each line from L3 or DRAM before writing it, and the packing was a quarter of the kernel's time
 * on the sweep's 16-256-token prompts. */
static inline __attribute__((always_inline)) int run_plan(const Plan *p, const Call *c, int qt, int unit_d,
                                                          PackUnit pack, QueryTile tile, void *scratch) {
    const int *seqs = c->seqs, Hkv = c->Hkv, group = c->H / c->Hkv;
    int rc = 0;
    if (p->fused) {
        uint16_t *buf = thread_buffer(p->unit_max);
        if (!buf) rc = -2;
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < p->n_work; i++) {
            if (!buf) continue;
            const int s = p->work[i].index / Hkv, g = p->work[i].index % Hkv,
                      tiles = (seqs[4 * s + 1] + qt - 1) / qt;
            const Unit u = {buf, buf + (size_t)ceil_to(seqs[4 * s + 3], 16) * unit_d};
            pack(c, s, g, u);
            for (int h = g * group; h < (g + 1) * group; h++)
                for (int t = tiles - 1; t >= 0; t--) tile(c, scratch, s, h, t, u);
        }
    } else {
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < p->units; i++)
            pack(c, i / Hkv, i % Hkv, plan_unit(p, seqs, i / Hkv, i % Hkv, unit_d));
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < p->n_work; i++) {
            int s, t, h;
            unfused_item(&p->work[i], seqs, c->H, qt, &s, &t, &h);
            tile(c, scratch, s, h, t, plan_unit(p, seqs, s, h / group, unit_d));
        }
    }
    return rc;
}

/* The online-softmax step of a query tile's 16 rows (one lane each) over n <= SOFTMAX_MAX_KEYS keys kb .. kb +
 * n - 1 (n a multiple of 16) of S^T [key][16] (not yet scaled), in base 2: scores scaled by c2 = scale *
 * log2(e), the running maxima m in those units, e = 2^(c2 S - m') as one fmsub and exp2h_512 (7
 * instructions; relative error 1.7e-7). Every step is a vector over the rows: no horizontal reductions, no
 * scalar code. Row r (position pos0 + r, r < nr) sees key j where lo(r) <= j <= pos0 + r. Writes alpha (the
 * factor O is rescaled by), updates m and l, and hands each pair of keys' probabilities (j, j + 1; zero
 * where a row does not see the key) to STORE(PT, j, e0, e1), which writes P^T in its kernel's layout. The
 * bfloat16 and float32 kernels define theirs with DEFINE_SOFTMAX_ROWS. */
#define SOFTMAX_MAX_KEYS 64
#define DEFINE_SOFTMAX_ROWS(NAME, STORE)                                                                    \
    static inline void NAME(const float *ST, int n, int kb, int pos0, int nr, int window, float c2, __m512 *m, \
                            __m512 *l, float *alpha, void *PT) {                                             \
        const unsigned rows = nr >= 16 ? 0xFFFFu : (1u << nr) - 1;                                          \
        __mmask16 mk[SOFTMAX_MAX_KEYS];                                                                     \
        for (int j = 0; j < n; j++) {                                                                       \
            const int lo = kb + j - pos0; /* rows r >= lo see key kb + j (causal) */                        \
            unsigned bits = lo <= 0 ? rows : lo >= 16 ? 0 : rows & ~((1u << lo) - 1);                       \
            if (window > 0) { /* and rows r <= lo + window - 1 (the window) */                              \
                const int hi = lo + window; /* rows below hi */                                             \
                bits &= hi <= 0 ? 0 : hi >= 16 ? 0xFFFFu : (1u << hi) - 1;                                  \
            }                                                                                               \
            mk[j] = (__mmask16)bits;                                                                        \
        }                                                                                                   \
        /* four running maxima: one would chain n dependent vmaxps, ~10% of a block's time at n = 64 */     \
        __m512 mx0 = _mm512_set1_ps(-INFINITY), mx1 = mx0, mx2 = mx0, mx3 = mx0;                            \
        for (int j = 0; j < n; j += 4) {                                                                    \
            mx0 = _mm512_mask_max_ps(mx0, mk[j], mx0, _mm512_loadu_ps(ST + j * 16));                        \
            mx1 = _mm512_mask_max_ps(mx1, mk[j + 1], mx1, _mm512_loadu_ps(ST + (j + 1) * 16));              \
            mx2 = _mm512_mask_max_ps(mx2, mk[j + 2], mx2, _mm512_loadu_ps(ST + (j + 2) * 16));              \
            mx3 = _mm512_mask_max_ps(mx3, mk[j + 3], mx3, _mm512_loadu_ps(ST + (j + 3) * 16));              \
        }                                                                                                   \
        const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx0, mx1), _mm512_max_ps(mx2, mx3));                  \
        const __m512 c2v = _mm512_set1_ps(c2);                                                              \
        const __mmask16 seen = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);              \
        const __m512 mold = *m, mnew = _mm512_mask_max_ps(mold, seen, mold, _mm512_mul_ps(mx, c2v));        \
        /* alpha = 2^(m - m'): 1 where the maximum stays (rows that have seen no key yet included: O, l     \
         * zero), 0 on a row's first keys (m = -inf) */                                                     \
        const __mmask16 grew = _mm512_cmp_ps_mask(mnew, mold, _CMP_GT_OQ);                                  \
        const __mmask16 first = _mm512_cmp_ps_mask(mold, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);            \
        __m512 a = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), grew,                                           \
                                      exp2h_512(_mm512_add_ps(_mm512_sub_ps(mold, mnew), _mm512_set1_ps(0.5f)))); \
        a = _mm512_mask_mov_ps(a, grew & first, _mm512_setzero_ps());                                       \
        _mm512_storeu_ps(alpha, a);                                                                         \
        const __m512 mh = _mm512_sub_ps(mnew, _mm512_set1_ps(0.5f)); /* exp2h_512 takes 2^(y - 1/2) */      \
        __m512 sum = _mm512_setzero_ps();                                                                   \
        for (int j = 0; j < n; j += 2) {                                                                    \
            const __m512 e0 = _mm512_maskz_mov_ps(                                                          \
                mk[j], exp2h_512(_mm512_fmsub_ps(_mm512_loadu_ps(ST + j * 16), c2v, mh)));                  \
            const __m512 e1 = _mm512_maskz_mov_ps(                                                          \
                mk[j + 1], exp2h_512(_mm512_fmsub_ps(_mm512_loadu_ps(ST + (j + 1) * 16), c2v, mh)));        \
            sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));                                                \
            STORE(PT, j, e0, e1);                                                                           \
        }                                                                                                   \
        *l = _mm512_add_ps(_mm512_mul_ps(*l, a), sum);                                                      \
        *m = mnew;                                                                                          \
    }

#endif
