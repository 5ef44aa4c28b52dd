/* Token sampling on CPU: temperature, top-k, top-p and min-p, one token a row, without sorting the
 * vocabulary.
 *
 * Why not torch: at batch 64 x 32000 the exponential race (argmax of p / q, q ~ Exp(1)) draws 2M random
 * numbers a step (~33 ms on two cores) and top-p sorts every row (~110 ms a step with it), where a decode
 * step of a 100M model takes ~50 ms. Here a row costs a few passes over its logits:
 *   1. x = logits / temperature and its maximum; e = exp(x - max)          (vector passes)
 *   2. top-k / top-p: where the order "x descending, then index ascending" must be cut, found by radix
 *      selection on x's bits with counts (top-k) or masses (top-p) per bucket: three levels of 11, 11
 *      and 10 bits, each over the previous level's bucket only, then the equal keys by index; over the
 *      row's head (head_tokens) where the cut is sure to fall in it;
 *   3. e set to 0 outside the cut and below min_p (e of the top token is 1: min_p's threshold is min_p);
 *   4. one uniform u a row (drawn by the caller from the row's generator): the token where the running
 *      sum of e, in index order, first exceeds u * sum(e): inverse-CDF sampling, exact for any order.
 * Filters compose as the torch path's (and HF's) do: top-k, then top-p over the top-k tokens'
 * renormalised probabilities, then min-p. Ties at a cut keep the lower token ids. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#define PAR_MIN_ROWS 2 /* one row's passes are ~50-150 us: worth a thread from two rows on */
#define BLOCK 512      /* e's running sum is kept per block of this many tokens (step 4 walks one block) */

/* x's bits as unsigned keys in x's order (NaN excluded by the caller): -inf lowest, +inf highest. A
 * negative float's bits are inverted, a positive one's sign bit set. */
static void order_keys(const float *x, int n, uint32_t *key) {
    for (int j = 0; j < n; j++) {
        uint32_t b;
        memcpy(&b, x + j, sizeof b);
        key[j] = b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u);
    }
}

/* A cut of the order (key descending, index ascending): the tokens before it and the token (key, index)
 * itself are kept. */
typedef struct {
    uint32_t key;
    int index;
} Cut;

static inline int kept(Cut c, uint32_t key, int j) { return key > c.key || (key == c.key && j <= c.index); }

/* The first level's histogram is kept in COPIES copies, token i in copy i % COPIES: a run of tokens in
 * one bucket (the usual case) would chain every add through one counter's store and reload. */
#define COPIES 4
typedef struct {
    double mass[COPIES][2048];
    int count[COPIES][2048];
} Histogram;

/* The first position in the order at which the running weight (1 a token with e == NULL, else e[j])
 * reaches target, found with three radix levels of bucket counts / masses over the tokens in list (the
 * first n tokens where list is NULL). cand: n ints of scratch. */
static Cut find_cut(const uint32_t *key, const float *e, const int *list, int n, double target, int *cand,
                    Histogram *h) {
    static const int shift[3] = {21, 10, 0}, bits[3] = {11, 11, 10};
    double (*mass)[2048] = h->mass;
    int (*count)[2048] = h->count;
    /* candidates: the tokens in list (all n first tokens where list is NULL), then one bucket's */
    uint32_t prefix = 0;
    double before = 0.0; /* the weight of every token ahead of the current bucket */
    for (int level = 0; level < 3; level++) {
        const int nb = 1 << bits[level], sh = shift[level], copies = level ? 1 : COPIES;
        for (int c = 0; c < copies; c++) {
            memset(count[c], 0, sizeof(int) * (size_t)nb);
            if (e) memset(mass[c], 0, sizeof(double) * (size_t)nb);
        }
        if (level == 0) {
            int i = 0;
            for (; i + COPIES <= n; i += COPIES)
                for (int c = 0; c < COPIES; c++) {
                    const int j = list ? list[i + c] : i + c, b = (int)(key[j] >> sh);
                    count[c][b]++;
                    if (e) mass[c][b] += e[j];
                }
            for (; i < n; i++) {
                const int j = list ? list[i] : i;
                count[0][key[j] >> sh]++;
                if (e) mass[0][key[j] >> sh] += e[j];
            }
            for (int c = 1; c < COPIES; c++)
                for (int b = 0; b < nb; b++) {
                    count[0][b] += count[c][b];
                    if (e) mass[0][b] += mass[c][b];
                }
        } else {
            for (int i = 0; i < n; i++) {
                const int j = cand[i], b = (int)(key[j] >> sh) & (nb - 1);
                count[0][b]++;
                if (e) mass[0][b] += e[j];
            }
        }
        int pick = -1, last = -1;
        for (int b = nb - 1; b >= 0; b--) {
            if (!count[0][b]) continue;
            last = b;
            const double w = e ? mass[0][b] : (double)count[0][b];
            if (before + w >= target) {
                pick = b;
                break;
            }
            before += w;
        }
        if (pick < 0) { /* rounding left the target unreached: the cut falls at the very end */
            pick = last;
            before -= e ? mass[0][last] : (double)count[0][last];
        }
        prefix |= (uint32_t)pick << sh;
        int m = 0; /* the picked bucket's tokens, in index order */
        if (level == 0) {
            for (int i = 0; i < n; i++) {
                const int j = list ? list[i] : i;
                if ((int)(key[j] >> sh) == pick) cand[m++] = j;
            }
        } else {
            for (int i = 0; i < n; i++)
                if ((int)(key[cand[i]] >> sh & (uint32_t)(nb - 1)) == pick) cand[m++] = cand[i];
        }
        n = m;
    }
    /* every candidate now has the key `prefix`: the order among them is by index */
    int at = cand[n - 1];
    for (int i = 0; i < n; i++) {
        before += e ? e[cand[i]] : 1.0;
        if (before >= target) {
            at = cand[i];
            break;
        }
    }
    return (Cut){prefix, at};
}

/* the first index of the row's maximum, or of its first NaN (torch's max(dim).indices) */
static int argmax_row(const float *x, int vocab) {
    int best = 0;
    float m = -INFINITY;
    for (int j = 0; j < vocab; j++) {
        if (x[j] != x[j]) return j;
        if (x[j] > m) {
            m = x[j];
            best = j;
        }
    }
    return best;
}

/* x = row / t, its maximum and whether it holds a NaN; e = exp(x - max); the sum of e per BLOCK. */
#ifdef HAVE_AVX512
#define DEFINE_SCALE(SUF, T, LOAD16)                                                                     \
static float scale_##SUF(const T *row, int vocab, float t, float *x, int *nan) {                         \
    const __m512 tv = _mm512_set1_ps(t);                                                                 \
    __m512 mx = _mm512_set1_ps(-INFINITY);                                                               \
    __mmask16 bad = 0;                                                                                   \
    for (int j = 0; j < vocab; j += 16) {                                                                \
        const __mmask16 mk = mask_upto(vocab - j);                                                       \
        const __m512 v = _mm512_div_ps(LOAD16(row + j, mk), tv);                                         \
        bad |= _mm512_mask_cmp_ps_mask(mk, v, v, _CMP_UNORD_Q);                                          \
        mx = _mm512_mask_max_ps(mx, mk, mx, v);                                                          \
        _mm512_mask_storeu_ps(x + j, mk, v);                                                             \
    }                                                                                                    \
    *nan = bad != 0;                                                                                    \
    return _mm512_reduce_max_ps(mx);                                                                     \
}
DEFINE_SCALE(f32, float, load16_f32)
DEFINE_SCALE(bf16, uint16_t, load16_bf16)

static double exp_blocks(const float *x, int vocab, float mx, float *e, double *bsum) {
    const __m512 m = _mm512_set1_ps(mx);
    double total = 0.0;
    for (int j0 = 0, blk = 0; j0 < vocab; j0 += BLOCK, blk++) {
        __m512 acc = _mm512_setzero_ps();
        const int end = j0 + BLOCK < vocab ? j0 + BLOCK : vocab;
        for (int j = j0; j < end; j += 16) {
            const __mmask16 mk = mask_upto(end - j);
            /* exp512 of -inf - max (a masked token) is its clamp's ~1e-38, not 0: zero it */
            const __m512 xv = _mm512_maskz_loadu_ps(mk, x + j);
            const __mmask16 live = _mm512_mask_cmp_ps_mask(mk, xv, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m512 v = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(xv, m)));
            _mm512_mask_storeu_ps(e + j, mk, v);
            acc = _mm512_add_ps(acc, v);
        }
        bsum[blk] = (double)_mm512_reduce_add_ps(acc);
        total += bsum[blk];
    }
    return total;
}
#else
#define DEFINE_SCALE(SUF, T, LOAD)                                                                       \
static float scale_##SUF(const T *row, int vocab, float t, float *x, int *nan) {                         \
    float mx = -INFINITY;                                                                                \
    *nan = 0;                                                                                           \
    for (int j = 0; j < vocab; j++) {                                                                    \
        x[j] = LOAD(row[j]) / t;                                                                         \
        if (x[j] != x[j]) *nan = 1;                                                                      \
        else if (x[j] > mx) mx = x[j];                                                                   \
    }                                                                                                    \
    return mx;                                                                                           \
}
DEFINE_SCALE(f32, float, load_f32)
DEFINE_SCALE(bf16, uint16_t, bf16_to_f32)

static double exp_blocks(const float *x, int vocab, float mx, float *e, double *bsum) {
    double total = 0.0;
    for (int j0 = 0, blk = 0; j0 < vocab; j0 += BLOCK, blk++) {
        float acc = 0.f;
        const int end = j0 + BLOCK < vocab ? j0 + BLOCK : vocab;
        for (int j = j0; j < end; j++) {
            e[j] = x[j] == -INFINITY ? 0.f : expf(x[j] - mx);
            acc += e[j];
        }
        bsum[blk] = (double)acc;
        total += bsum[blk];
    }
    return total;
}
#endif

/* The cuts of top-k and top-p fall among the tokens near the row's maximum unless those are fewer than k
 * (top-k) or hold less than top-p of the mass; with a trained model's logits a few dozen tokens of the
 * vocabulary are within a few nats of the maximum, so the radix selection runs over them alone. The
 * head is the narrowest of GAPS (x >= max - gap) that holds what the cuts need (need_count tokens, and
 * need_mass of e, summed as the caller's total is, up to rounding); head: its ids, in order; thr: its
 * lowest x. Returns its size, or 0 where no gap holds enough (the cuts then run over the whole row). */
#define NGAPS 6
static const float GAPS[NGAPS] = {4.f, 8.f, 12.f, 16.f, 24.f, 32.f}; /* e >= 1.3e-14 at the widest */
static int head_tokens(const float *x, const float *e, int vocab, float mx, int need_count, double need_mass,
                       int *head, float *thr) {
    int count[NGAPS] = {0};
    double mass[NGAPS] = {0};
#ifdef HAVE_AVX512
    __m512 acc[NGAPS];
    for (int g = 0; g < NGAPS; g++) acc[g] = _mm512_setzero_ps();
    for (int j = 0; j < vocab; j += 16) {
        const __mmask16 mk = mask_upto(vocab - j);
        const __m512 xv = _mm512_maskz_loadu_ps(mk, x + j), ev = _mm512_maskz_loadu_ps(mk, e + j);
        for (int g = 0; g < NGAPS; g++) {
            const __mmask16 in = _mm512_mask_cmp_ps_mask(mk, xv, _mm512_set1_ps(mx - GAPS[g]), _CMP_GE_OQ);
            count[g] += __builtin_popcount(in);
            acc[g] = _mm512_mask_add_ps(acc[g], in, acc[g], ev);
        }
    }
    for (int g = 0; g < NGAPS; g++) mass[g] = (double)_mm512_reduce_add_ps(acc[g]);
#else
    float acc[NGAPS] = {0};
    for (int j = 0; j < vocab; j++)
        for (int g = 0; g < NGAPS; g++)
            if (x[j] >= mx - GAPS[g]) {
                count[g]++;
                acc[g] += e[j];
            }
    for (int g = 0; g < NGAPS; g++) mass[g] = (double)acc[g];
#endif
    int g = 0;
    while (g < NGAPS && (count[g] < need_count || mass[g] < need_mass)) g++;
    if (g == NGAPS || count[g] > vocab / 2) return 0; /* (half the row or more: no saving) */
    *thr = mx - GAPS[g];
    int n = 0;
#ifdef HAVE_AVX512
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int j = 0; j < vocab; j += 16) {
        const __mmask16 mk = mask_upto(vocab - j);
        const __mmask16 in =
            _mm512_mask_cmp_ps_mask(mk, _mm512_maskz_loadu_ps(mk, x + j), _mm512_set1_ps(*thr), _CMP_GE_OQ);
        _mm512_mask_compressstoreu_epi32(head + n, in, at);
        n += __builtin_popcount(in);
        at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
    }
#else
    for (int j = 0; j < vocab; j++)
        if (x[j] >= *thr) head[n++] = j;
#endif
    return n;
}

/* The block sums again after e was zeroed outside the kept tokens (in 16 lanes: a float sum in order is
 * a chain of dependent adds, 4 cycles a token). */
static double block_sums(const float *e, int vocab, double *bsum) {
    double total = 0.0;
    for (int j0 = 0, blk = 0; j0 < vocab; j0 += BLOCK, blk++) {
        const int end = j0 + BLOCK < vocab ? j0 + BLOCK : vocab;
#ifdef HAVE_AVX512
        __m512 acc = _mm512_setzero_ps();
        for (int j = j0; j < end; j += 16)
            acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask_upto(end - j), e + j));
        bsum[blk] = (double)_mm512_reduce_add_ps(acc);
#else
        float acc = 0.f;
        for (int j = j0; j < end; j++) acc += e[j];
        bsum[blk] = (double)acc;
#endif
        total += bsum[blk];
    }
    return total;
}

/* One row (scaled logits already in x, its maximum mx): filters, then the inverse-CDF draw. */
static int sample_scaled(float *x, float *e, uint32_t *key, double *bsum, int *cand, int *head, Histogram *h,
                         int vocab, float mx, int top_k, float top_p, float min_p, double u) {
    double total = exp_blocks(x, vocab, mx, e, bsum);
    const int cut_k = top_k > 0 && top_k < vocab, cut_p = top_p < 1.f, cut_m = min_p > 0.f;
    if (cut_k || cut_p) {
        /* the head must hold the top-k tokens, and top-p of the mass (with a margin for rounding) where
         * top-p runs over the whole row; top-p after top-k stays inside the top-k tokens */
        float thr = 0.f;
        const int nh = head_tokens(x, e, vocab, mx, cut_k ? top_k : 0,
                                   !cut_k && cut_p ? ((double)top_p + 1e-5) * total : 0.0, head, &thr);
        const int in_head = nh > 0;
        const int *list = in_head ? head : NULL, n = in_head ? nh : vocab;
        if (in_head) /* keys for the head alone: the cuts and the zeroing below read no others */
            for (int i = 0; i < nh; i++) order_keys(x + head[i], 1, key + head[i]);
        else
            order_keys(x, vocab, key);
        Cut cut = {0, vocab}; /* everything */
        if (cut_k) cut = find_cut(key, NULL, list, n, (double)top_k, cand, h);
        if (cut_p) {
            double mass = total; /* the top-k tokens' mass: top-p renormalises over them */
            if (cut_k) {
                mass = 0.0;
                for (int i = 0; i < n; i++) {
                    const int j = list ? list[i] : i;
                    if (kept(cut, key[j], j)) mass += e[j];
                }
            }
            const Cut c = find_cut(key, e, list, n, (double)top_p * mass, cand, h);
            if (!cut_k || c.key > cut.key || (c.key == cut.key && c.index < cut.index)) cut = c;
        }
        if (in_head) { /* every token outside the head is past the cut */
            for (int j = 0; j < vocab; j++)
                if (!(x[j] >= thr)) e[j] = 0.f;
            for (int i = 0; i < nh; i++)
                if (!kept(cut, key[head[i]], head[i])) e[head[i]] = 0.f;
        } else {
            for (int j = 0; j < vocab; j++)
                if (!kept(cut, key[j], j)) e[j] = 0.f;
        }
    }
    if (cut_m)
        for (int j = 0; j < vocab; j++)
            if (e[j] < min_p) e[j] = 0.f;
    if (cut_k || cut_p || cut_m) total = block_sums(e, vocab, bsum);
    if (!(total > 0.0)) return argmax_row(x, vocab); /* nothing to draw from (all -inf) */
    const double target = u * total;
    double run = 0.0;
    int blk = 0;
    const int nblk = (vocab + BLOCK - 1) / BLOCK;
    while (blk < nblk - 1 && run + bsum[blk] <= target) run += bsum[blk++];
    int last = -1;
    const int end = (blk + 1) * BLOCK < vocab ? (blk + 1) * BLOCK : vocab;
    for (int j = blk * BLOCK; j < end; j++) {
        if (e[j] <= 0.f) continue;
        last = j;
        run += e[j];
        if (run > target) return j;
    }
    if (last >= 0) return last; /* rounding: the block's last live token */
    for (int j = vocab - 1; j >= 0; j--) /* (an empty block, by rounding of the block sums) */
        if (e[j] > 0.f) return j;
    return argmax_row(x, vocab);
}

/* out[i] = a token of row i: greedy where temperature[i] == 0, else sampled as described at the top;
 * u[i] in [0, 1). Returns 0, or -2 when scratch could not be allocated. */
#define DEFINE_SAMPLE(SUF, T, LOAD)                                                                      \
int sample_rows_##SUF(const T *logits, long stride, int rows, int vocab, const float *temperature,       \
                      const int32_t *top_k, const float *top_p, const float *min_p, const double *u,     \
                      int64_t *out, int num_threads) {                                                   \
    int failed = 0;                                                                                      \
    const int nblk = (vocab + BLOCK - 1) / BLOCK;                                                        \
    _Pragma("omp parallel num_threads(num_threads) if (rows >= PAR_MIN_ROWS)")                           \
    {                                                                                                    \
        float *x = (float *)malloc(sizeof(float) * 3 * (size_t)vocab); /* x, e, keys */                  \
        int *cand = (int *)malloc(sizeof(int) * 2 * (size_t)vocab); /* cand, head */                     \
        double *bsum = (double *)malloc(sizeof(double) * (size_t)nblk);                                  \
        Histogram *h = (Histogram *)malloc(sizeof(Histogram));                                           \
        if (!x || !cand || !bsum || !h) {                                                                \
            _Pragma("omp atomic write")                                                                  \
            failed = 1;                                                                                  \
        }                                                                                                \
        _Pragma("omp for schedule(dynamic, 1)")                                                          \
        for (int r = 0; r < rows; r++) {                                                                 \
            if (!x || !cand || !bsum || !h) continue;                                                    \
            const T *row = logits + (long)r * stride;                                                    \
            if (temperature[r] == 0.f) {                                                                 \
                for (int j = 0; j < vocab; j++) x[j] = LOAD(row[j]);                                     \
                out[r] = argmax_row(x, vocab);                                                           \
                continue;                                                                                \
            }                                                                                            \
            int nan;                                                                                     \
            const float mx = scale_##SUF(row, vocab, temperature[r], x, &nan);                           \
            /* a NaN, no finite logit or an infinite one: no distribution to draw from */                \
            out[r] = nan || isinf(mx) ? argmax_row(x, vocab)                                             \
                                      : sample_scaled(x, x + vocab, (uint32_t *)(x + 2 * (size_t)vocab), \
                                                      bsum, cand, cand + vocab, h, vocab, mx, top_k[r],  \
                                                      top_p[r], min_p[r], u[r]);                         \
        }                                                                                                \
        free(x);                                                                                         \
        free(cand);                                                                                      \
        free(bsum);                                                                                      \
        free(h);                                                                                         \
    }                                                                                                    \
    return failed ? -2 : 0;                                                                              \
}
DEFINE_SAMPLE(f32, float, load_f32)
DEFINE_SAMPLE(bf16, uint16_t, bf16_to_f32)
