/* What the prompt-attention kernels (amx_attention.c on AMX tiles, bf16_attention.c on AVX512-BF16,
 * f32_attention.c in float32) share: their call's arguments, the key masks, the 16 x 16 word transpose
 * that packs K, where a (sequence, KV head)'s packed K / V live, the work plan (validation, the per-thread
 * packing buffer, the costliest-first list of work items) and its run, and (the two without AMX) the
 * online softmax's row step. Each kernel packs and multiplies its own way. Included only where the build
 * has AVX-512; cpu/build.py hashes this file into every library's cache key. */
#ifndef ASYNCENGINE_PROMPT_ATTENTION_H
#define ASYNCENGINE_PROMPT_ATTENTION_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h" /* exp512 */

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

/* 16 x 16 32-bit words, transposed in registers (r[i] holds row i; afterwards column i). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

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
    size_t *base; /* [num_seqs + 1]: where each sequence's units start in kv */
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
    p->base = malloc(sizeof(size_t) * (num_seqs + 1));
    p->n_work = p->fused ? p->units : (long)items;
    p->work = malloc(sizeof(Ranked) * p->n_work);
    if (!p->base || !p->work) return -2;
    p->base[0] = 0;
    for (int s = 0; s < num_seqs; s++) p->base[s + 1] = p->base[s] + Hkv * unit_size(seqs[4 * s + 3], D);
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

/* Row r's online-softmax step over a block of nb <= 4 16-key groups of its scores sr (not yet scaled), keys
 * kb .. kb + 16 nb - 1, of which it sees lo .. pos (none with pos < 0: a padding row): e[n] = exp(scale S -
 * m') (zero on keys it does not see), *alpha = exp(m - m') (0 on its first block), m = m' and l = alpha l +
 * sum(e). Where it sees no key of the block, e is zero, *alpha = 1 and m, l stay. */
static inline void softmax_step(const float *sr, int nb, int kb, int lo, int pos, float scale, float *m,
                                float *l, float *alpha, __m512 e[4]) {
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int n = 0; n < nb; n++) {
        const __mmask16 mk = valid_keys(kb + 16 * n, lo, pos);
        mx = _mm512_max_ps(mx, _mm512_mask_mul_ps(mx, mk, _mm512_maskz_loadu_ps(mk, sr + 16 * n), sc));
    }
    const float bm = _mm512_reduce_max_ps(mx);
    if (bm == -INFINITY) {
        for (int n = 0; n < nb; n++) e[n] = _mm512_setzero_ps();
        *alpha = 1.0f;
        return;
    }
    const float mn = bm > *m ? bm : *m;
    *alpha = expf(*m - mn);
    const __m512 mv = _mm512_set1_ps(mn);
    __m512 sum = _mm512_setzero_ps();
    for (int n = 0; n < nb; n++) {
        const __mmask16 mk = valid_keys(kb + 16 * n, lo, pos);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, sr + 16 * n), sc);
        e[n] = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(x, mv)));
        sum = _mm512_add_ps(sum, e[n]);
    }
    *l = *l * *alpha + _mm512_reduce_add_ps(sum);
    *m = mn;
}

#endif
