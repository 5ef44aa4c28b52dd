/* bfloat16 GEMM on Intel AMX for the linear layers of a CPU worker: out[M, N] = x[M, K] W[N, K]^T (+ bias).
 *
 * Why not oneDNN (torch.ops.mkldnn._linear_pointwise on a pre-reordered weight): at the M of a decode step
 * its GEMMs read the weights at ~19-22 GB/s where this machine's cores can stream ~26-31, and it does not
 * overlap the AMX arithmetic with the weight reads. Measured on the bench's medium model (12 layers + LM
 * head, 219 MB of weights, cold, 2 threads): M = 1 9.6 -> 7.0 ms, M = 32 11.5 -> 8.3 ms, M = 64 12.3-13.4 ->
 * 10.9 ms (bench/cpu_kernels.py prints the comparison).
 *
 * The weight is packed once, at load, into AMX's B-tile layout: for each block of 16 output features and 32
 * input features, a 1 KiB tile of 16 rows (one per pair of inputs) x 16 features x the pair; blocks of one
 * output block run along K, so a block's weights are one contiguous stream:
 *     packed [ceil(N/16)][K/32][16 pairs][16 features][2] bfloat16, zero past N.
 * K must be a multiple of 32 (the caller pads x and W otherwise).
 *
 * The products of two bfloat16 are exact in float32 and each output is accumulated in float32 over K in a
 * fixed order that does not depend on M or on the other rows: a row's output is the same whatever batch it
 * is computed in. Rounded to bfloat16 once (to nearest even), after the bias, as torch rounds.
 *
 * Threads split the output blocks (each its share, taking over others' when done: Shares below); rows go in
 * blocks of ROW_BLOCK (x's block stays in L2) and, within one, in chunks of 32 (four accumulator tiles: 2
 * row tiles x 2 output blocks) or, for M <= 16, one row tile against 4 output blocks. A chunk of a row block
 * reads its weights from DRAM, the block's later chunks from L2; the next group's weights are prefetched
 * evenly over the current group so that DRAM streams while the tiles compute. From LARGE_M rows on (prefill
 * chunks) the tile products, not DRAM, are the bound, and feeding both x and the weight tiles from L2 for
 * every product is more than L2 delivers: K then goes in blocks of KB_BLOCK tiles whose weights stay in L1
 * across the row chunks, the accumulators parked in memory between K blocks (same sums, same order). The
 * outputs of STAGE_GROUPS groups are gathered in a staging buffer and written row by row: a 32-column strip
 * alone is one cache line per row, and rows 8 KiB apart all fall in one cache set. Measured on the medium
 * model's 48 layer GEMMs, interleaved, outputs preallocated: M = 512 45 -> 42-45 ms (oneDNN 48-49), M = 2048
 * 185 -> 155 ms (oneDNN 125-137); M <= 128 is oneDNN's 1.1-1.4x. On that path two more things (2026-12-05, a
 * Xeon with AMX): the next K block's weight tiles (or the next group's first) are prefetched into L1 while
 * the current block's chunks compute, so that no chunk waits on them from L3; and the staged rows go out
 * with non-temporal stores when aligned: a prefill GEMM's output is megabytes, past L2, and every plain
 * store of a line not in cache first read it (RFO). The 48 layer GEMMs at M = 2048 went 2.2-2.5 -> 2.4-2.7
 * TFLOP/s (interleaved pairs), a ModelRunner's prefill of 64 prompts of 16-256 tokens 0.75-0.79 -> 0.71-0.75
 * s. Measured bounds on this CPU: one core's tile products peak at ~3.7 TFLOP/s and keep 94% of it with one
 * operand streaming from L2 and the other in L1, 63% once the accumulators of 8 chunks (32 KiB) are parked
 * in memory between K blocks as here. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include "amx_common.h" /* request_tiles, TileConfig, configure_tiles, TILE */
#include "cpu_common.h" /* exp512: the same SiLU as cpu_ops.c's silu_and_mul */
#include <omp.h>

#ifndef ROW_BLOCK
#define ROW_BLOCK 256
#endif
#ifndef LARGE_M
#define LARGE_M 128
#endif
#ifndef KB_BLOCK
#define KB_BLOCK 8
#endif
#ifndef STAGE_GROUPS
#define STAGE_GROUPS 8
#endif
int amx_available(void) { return request_tiles(); }

size_t amx_packed_size(int N, int K) { return (size_t)((N + 15) / 16) * (size_t)(K / 32) * TILE; }

/* Output block `nb` of the packed weight from W's rows first_row .. first_row + 15 (zero past N). */
static void pack_block(const uint16_t *w, uint16_t *packed, int N, int K, int nb, int first_row) {
    const int KB = K / 32;
    for (int kb = 0; kb < KB; kb++) {
        uint16_t *t = packed + ((size_t)nb * KB + kb) * TILE;
        for (int r = 0; r < 16; r++)
            for (int n = 0; n < 16; n++) {
                const int row = first_row + n;
                const uint16_t *src = w + (size_t)row * K + kb * 32 + 2 * r;
                t[r * 32 + n * 2] = row < N ? src[0] : 0;
                t[r * 32 + n * 2 + 1] = row < N ? src[1] : 0;
            }
    }
}

void amx_pack_bf16(const uint16_t *w, uint16_t *packed, int N, int K) {
    for (int nb = 0; nb < (N + 15) / 16; nb++) pack_block(w, packed, N, K, nb, nb * 16);
}

/* A merged [gate | up] weight (N = 2 * inter, inter % 16 == 0) with its blocks interleaved, gate block j
 * then up block j: every group of the kernel then holds matching gate and up accumulators, and
 * amx_linear_bf16(..., gated = 1) writes silu(gate) * up. */
void amx_pack_bf16_gated(const uint16_t *w, uint16_t *packed, int N, int K) {
    const int inter = N / 2;
    for (int j = 0; j < inter / 16; j++) {
        pack_block(w, packed, N, K, 2 * j, 16 * j);
        pack_block(w, packed, N, K, 2 * j + 1, inter + 16 * j);
    }
}

/* configure_tiles (amx_common.h): tiles 4, 5 hold rows of x, 6, 7 weight tiles. */

/* The four accumulator tiles (0-3): zeroed, or loaded from / stored to 4 x 256 floats at p (tile t at
 * p + 256 t). */
/* clang-format off */
static inline void zero_accs(void) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
static inline void load_accs(const float *p) {
    _tile_loadd(0, p, 64); _tile_loadd(1, p + 256, 64); _tile_loadd(2, p + 512, 64);
    _tile_loadd(3, p + 768, 64);
}
static inline void store_accs(float *p) {
    _tile_stored(0, p, 64); _tile_stored(1, p + 256, 64); _tile_stored(2, p + 512, 64);
    _tile_stored(3, p + 768, 64);
}
/* clang-format on */

/* `rows` rows of one accumulator tile (float32 [16][16]) + bias -> bfloat16, `cols` <= 16 columns. */
static inline void store_rows(const float *acc, int rows, int cols, uint16_t *out, long out_stride,
                              const uint16_t *bias) {
    const __mmask16 mk = (__mmask16)((1u << cols) - 1);
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, bias)), 16))
                          : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++)
        _mm256_mask_storeu_epi16(
            out + r * out_stride, mk,
            bf16_pack(_mm512_add_ps(_mm512_loadu_ps(acc + r * 16), b)));
}

/* `rows` rows of two adjacent accumulator tiles + bias -> bfloat16, `cols` <= 32 columns: one 64-byte store
 * per row (a whole cache line when out is aligned), not two half-line ones. */
static inline void store_rows2(const float *acc0, const float *acc1, int rows, int cols, uint16_t *out,
                               long out_stride, const uint16_t *bias) {
    const __mmask32 mk = mask32_upto(cols);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        const __m512i bb = _mm512_maskz_loadu_epi16(mk, bias);
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bb)), 16));
        b1 = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bb, 1)), 16));
    }
    for (int r = 0; r < rows; r++) {
        const __m256i lo = bf16_pack(_mm512_add_ps(_mm512_loadu_ps(acc0 + r * 16), b0));
        const __m256i hi = bf16_pack(_mm512_add_ps(_mm512_loadu_ps(acc1 + r * 16), b1));
        _mm512_mask_storeu_epi16(out + r * out_stride, mk,
                                 _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    }
}

/* `rows` rows of a gate and an up accumulator tile (+ their biases) -> 16 columns of T(silu(g)) * u with
 * g, u the bfloat16 projections: cpu_ops.c's silu_and_mul on the rounded GEMM output, bit for bit. Every
 * rounding here is cpu_common.h's bf16_pack / bf16_round, as in the plain stores above and in cpu_ops.c:
 * torch's (vcvtneps2bf16 alone flushes a denormal to zero where torch keeps it). */
static inline void store_gated(const float *acc_g, const float *acc_u, int rows, uint16_t *out,
                               long out_stride, const uint16_t *bias_g, const uint16_t *bias_u) {
    const __m512 bg = bias_g ? load16_bf16(bias_g, 0xFFFF) : _mm512_setzero_ps();
    const __m512 bu = bias_u ? load16_bf16(bias_u, 0xFFFF) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 g = bf16_round(_mm512_add_ps(_mm512_loadu_ps(acc_g + r * 16), bg));
        const __m512 u = bf16_round(_mm512_add_ps(_mm512_loadu_ps(acc_u + r * 16), bu));
        const __m512 a = _mm512_div_ps(
            g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm256_storeu_si256((__m256i *)(out + r * out_stride),
                            bf16_pack(_mm512_mul_ps(bf16_round(a), u)));
    }
}

static inline void prefetch_tile(const uint16_t *p, int hint_l2) {
    for (int b = 0; b < 1024; b += 64)
        if (hint_l2)
            _mm_prefetch((const char *)p + b, _MM_HINT_T1);
        else
            _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* One chunk of up to 32 rows of x: two row tiles (the second only when `two`), each with its row stride;
 * the tile holding M's last rows, when M > 16 is not a multiple of 16, is the zero-padded copy `tail`. */
typedef struct {
    const uint16_t *x0, *x1;
    long stride0, stride1;
    int two;
} RowChunk;
static inline RowChunk row_chunk(const uint16_t *x, long x_stride, const uint16_t *tail, int tail_row, int K,
                                 int m0, int r1) {
    return (RowChunk){m0 == tail_row ? tail : x + (long)m0 * x_stride,
                      m0 + 16 == tail_row ? tail : x + (long)(m0 + 16) * x_stride,
                      m0 == tail_row ? K : x_stride, m0 + 16 == tail_row ? K : x_stride, m0 + 16 < r1};
}

/* The last 16-row tile of x when M > 16 is not a multiple of 16 (its first row; -1: none) ... */
static inline int tail_row_of(int M) { return M > 16 && M % 16 ? M / 16 * 16 : -1; }
/* ... copied and zero-padded to 16 rows of K (row stride K), or NULL when it cannot be allocated. */
static uint16_t *copy_tail(const uint16_t *x, long x_stride, int tail_row, int M, int K) {
    uint16_t *tail = (uint16_t *)calloc((size_t)16 * K, sizeof(uint16_t));
    if (tail)
        for (int r = tail_row; r < M; r++)
            memcpy(tail + (size_t)(r - tail_row) * K, x + r * x_stride, (size_t)K * 2);
    return tail;
}

/* The next group's weights prefetched into L2, `tiles` of them spread evenly over `steps` calls of
 * prefetch_step (Bresenham); `next` NULL: none. */
typedef struct {
    const uint16_t *next;
    long tiles, steps, acc, done;
} Prefetch;
static inline void prefetch_step(Prefetch *pf) {
    if (!pf || !pf->next) return;
    for (pf->acc += pf->tiles; pf->acc >= pf->steps; pf->acc -= pf->steps)
        prefetch_tile(pf->next + (pf->done++) * TILE, 1);
}

/* Accumulators 0-3 (row tile t, output block j in tile 2t + j) += the chunk's rows times K tiles
 * kb0 .. kb1 - 1 of `nbn` (1 or 2) output blocks starting at b0. */
static inline void chunk_products(const RowChunk *ch, const uint16_t *b0, int kb0, int kb1, int nbn,
                                  size_t block_stride, Prefetch *pf) {
    for (int kb = kb0; kb < kb1; kb++) {
        const uint16_t *bk = b0 + (size_t)kb * TILE;
        prefetch_step(pf);
        _tile_loadd(4, ch->x0 + kb * 32, ch->stride0 * 2);
        _tile_loadd(6, bk, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (ch->two) {
            _tile_loadd(5, ch->x1 + kb * 32, ch->stride1 * 2);
            _tile_dpbf16ps(2, 5, 6);
        }
        if (nbn > 1) {
            _tile_loadd(7, bk + block_stride, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (ch->two) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

#ifndef NT_FLUSH
#define NT_FLUSH 1
#endif
/* One staged row (`width` bfloat16) -> out. */
static inline void flush_row(uint16_t *dst, const uint16_t *src, int width) {
    if (NT_FLUSH && (uintptr_t)dst % 64 == 0 && width % 32 == 0) {
        for (int i = 0; i < width; i += 32)
            _mm512_stream_si512((__m512i *)(dst + i), _mm512_load_si512((const __m512i *)(src + i)));
        return;
    }
    memcpy(dst, src, (size_t)width * 2);
}

/* The large-M path's prefetch: `nk` K tiles from kb of `nbn` output blocks starting at `base` (block_stride
 * apart), i.e. nbn * nk * 16 cache lines, issued evenly over `steps` K steps into L1. */
typedef struct {
    const uint16_t *base;
    int kb, nk, nbn;
    size_t block_stride;
    long steps, step;
} BlockPrefetch;
static inline void block_prefetch_step(BlockPrefetch *bp) {
    if (!bp || !bp->base) return;
    const long lines = (long)bp->nbn * bp->nk * 16, s = bp->step++;
    for (long l = lines * s / bp->steps; l < lines * (s + 1) / bp->steps; l++) {
        const long per_block = (long)bp->nk * 16;
        const char *p = (const char *)(bp->base + (l / per_block) * bp->block_stride + (size_t)bp->kb * TILE)
                        + (l % per_block) * 64;
        _mm_prefetch(p, _MM_HINT_T0);
    }
}

/* The quantized path's next K block, dequantized while the current one's tile products run (below). */
typedef struct DequantAhead DequantAhead;
static inline void dequant_step(DequantAhead *da);

/* chunk_products with a BlockPrefetch step and a DequantAhead step (either NULL: none) per K step; the
 * step's tile products are issued first, so that the vector work runs while the tiles compute. */
static inline void chunk_products_bp(const RowChunk *ch, const uint16_t *b0, int kb0, int kb1, int nbn,
                                     size_t block_stride, BlockPrefetch *bp, DequantAhead *da) {
    for (int kb = kb0; kb < kb1; kb++) {
        block_prefetch_step(bp);
        chunk_products(ch, b0, kb, kb + 1, nbn, block_stride, NULL);
        if (da) dequant_step(da);
    }
}

/* The large-M path's inner loop: each 32-row chunk of rows r0 .. r1 - 1 times K tiles k0 .. k1 - 1 of the
 * group's blocks at b0, its accumulators parked in `spill` (1024 floats a chunk) between K blocks. */
static inline void spilled_chunks(const uint16_t *x, long x_stride, const uint16_t *tail, int tail_row, int K,
                                  int r0, int r1, float *spill, const uint16_t *b0, int k0, int k1, int nbn,
                                  size_t block_stride, BlockPrefetch *bp, DequantAhead *da) {
    for (int c = 0; c < (r1 - r0 + 31) / 32; c++) {
        const RowChunk ch = row_chunk(x, x_stride, tail, tail_row, K, r0 + 32 * c, r1);
        float *sp = spill + (size_t)c * 1024;
        if (k0 == 0)
            zero_accs();
        else
            load_accs(sp);
        chunk_products_bp(&ch, b0, k0, k1, nbn, block_stride, bp, da);
        store_accs(sp);
    }
}

/* `rows` rows of a group's two accumulator tiles (a0, a1) -> out: columns `col` .. of the output, which are
 * col = group * 32 plainly (`cols` of them) or group * 16 gated (a0 gate, a1 up: silu(gate) * up). */
static inline void store_group(const float *a0, const float *a1, int rows, int cols, uint16_t *out,
                               long out_stride, const uint16_t *bias, int col, int inter, int gated) {
    if (gated)
        store_gated(a0, a1, rows, out, out_stride, bias ? bias + col : NULL,
                    bias ? bias + inter + col : NULL);
    else
        store_rows2(a0, a1, rows, cols, out, out_stride, bias ? bias + col : NULL);
}

/* The threads' work. Each thread owns the share of the groups a fixed split gives it (as before: for every
 * row block, the same contiguous stretch of the weights, which then stays in its L2 from one row block to
 * the next), cut into items of one row block and up to `per` groups and taken in order from the front of
 * its queue; a thread whose queue is empty takes items from the back of the others'. A fixed split alone
 * makes the whole call wait for the slower thread, and on a CPU shared with a server, a scheduler or a
 * noisy neighbour one of them often is: the medium model's four layer GEMMs at M = 2048, with a process
 * busy half the time on one of the two cores, 23.8-27.3 ms -> ~17.7 ms. From LARGE_M rows on a share is
 * cut into at least ITEMS_PER_THREAD items (`per` halved as needed, at most STAGE_GROUPS; 2 rather than 4:
 * at M = 128, one row block, the shorter runs of 4 cost 1-2%); below (decode steps, GEMMs of tens of
 * microseconds, where shorter runs break the hardware prefetcher's streams across groups: 2-4% slower at
 * M = 1-64) a share is one item. Each output is computed by one thread in the same order whichever thread
 * that is: the result does not depend on the split. */
#ifndef ITEMS_PER_THREAD
#define ITEMS_PER_THREAD 2
#endif
typedef struct { int groups, threads, per, row_blocks; } Shares;
static inline Shares plan_shares(int groups, int threads, int row_blocks, int large) {
    const int smallest = groups / threads > 0 ? groups / threads : 1;
    int per = large ? (smallest < STAGE_GROUPS ? smallest : STAGE_GROUPS) : groups;
    while (large && per > 1 && (long)row_blocks * ((smallest + per - 1) / per) < ITEMS_PER_THREAD)
        per = (per + 1) / 2;
    return (Shares){groups, threads, per, row_blocks};
}
static inline int share_begin(const Shares *s, int t) { return (int)((long)s->groups * t / s->threads); }
static inline int share_runs(const Shares *s, int t) {
    return (share_begin(s, t + 1) - share_begin(s, t) + s->per - 1) / s->per;
}
/* Item j of thread t's share: its row block and groups [g_begin, g_end). */
typedef struct { int row_block, g_begin, g_end; } ItemRange;
static inline ItemRange share_item(const Shares *s, int t, long j) {
    const int runs = share_runs(s, t), end = share_begin(s, t + 1);
    const int g_begin = share_begin(s, t) + (int)(j % runs) * s->per;
    return (ItemRange){(int)(j / runs), g_begin, g_begin + s->per < end ? g_begin + s->per : end};
}
/* A queue of items: the next from the front (low 32 bits) and one past the last from the back (high 32),
 * in one word so that the owner and a thief can never take the same item. Returns the item, -1: empty. */
static inline long queue_take(long *q, int from_back) {
    long cur = __atomic_load_n(q, __ATOMIC_RELAXED);
    for (;;) {
        const long front = cur & 0xffffffffL, back = cur >> 32;
        if (front >= back) return -1;
        const long next = from_back ? (back - 1) << 32 | front : back << 32 | (front + 1);
        if (__atomic_compare_exchange_n(q, &cur, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return from_back ? back - 1 : front;
    }
}
/* Each thread's queue, full: every item of its share ahead; NULL when it cannot be allocated. */
static long *share_queues(const Shares *s) {
    long *queues = (long *)malloc(sizeof(long) * (size_t)s->threads);
    if (queues)
        for (int t = 0; t < s->threads; t++) queues[t] = (long)s->row_blocks * share_runs(s, t) << 32;
    return queues;
}
/* The next item for thread `tid`: its own queue's front, else another's back; *owner: whose share. */
static inline long next_item(long *queues, int threads, int tid, int *owner) {
    long j = queue_take(&queues[tid], 0);
    *owner = tid;
    for (int v = 1; j < 0 && v < threads; v++) {
        *owner = (tid + v) % threads;
        j = queue_take(&queues[*owner], 1);
    }
    return j;
}
/* x [M, K] with row stride x_stride, out [M, N] with row stride out_stride (elements); bias [N] or NULL.
 * gated: the weight came from amx_pack_bf16_gated and out is [M, N / 2] = silu(gate) * up.
 * Returns 0, -1 for K not a multiple of 32 (or a gated N not of 32), -2 when scratch cannot be allocated. */
int amx_linear_bf16(const uint16_t *x, long x_stride, const uint16_t *packed, const uint16_t *bias,
                    uint16_t *out, long out_stride, int M, int N, int K, int num_threads, int gated) {
    const int inter = N / 2; /* gated: out is [M, inter], bias [gate | up] */
    const int out_group = gated ? 16 : 32; /* output columns of a 2-block group */
    if (gated && N % 32) return -1;
    if (K % 32 || K <= 0) return -1;
    if (M <= 0 || N <= 0) return 0;
    const int NB = (N + 15) / 16, KB = K / 32;
    const int width = M <= 16 ? 4 : 2; /* output blocks per group */
    const int groups = (NB + width - 1) / width;
    const size_t block_stride = (size_t)KB * TILE; /* one output block's weights */
    const int threads = num_threads > 0 ? num_threads : 1;
    const Shares shares =
        plan_shares(groups, threads, width == 4 ? 1 : (M + ROW_BLOCK - 1) / ROW_BLOCK, M >= LARGE_M);
    long *queues = share_queues(&shares);
    if (!queues) return -2;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float acc[4][256] __attribute__((aligned(64)));
        /* accumulators of a row block's chunks between K blocks (the large-M path): [chunks][4 tiles][256] */
        float *spill =
            M >= LARGE_M ? (float *)aligned_alloc(64, (size_t)(ROW_BLOCK / 32) * 1024 * sizeof(float)) : NULL;
        uint16_t *stage =
            M >= LARGE_M ? (uint16_t *)aligned_alloc(64, (size_t)ROW_BLOCK * STAGE_GROUPS * 32 * 2) : NULL;
        const int tail_row = tail_row_of(M);
        uint16_t *tail = tail_row >= 0 ? copy_tail(x, x_stride, tail_row, M, K) : NULL;
        if (tail_row >= 0 && !tail) {
#pragma omp atomic write
            failed = 1;
        }
        /* an OpenMP runtime may give fewer threads than asked: the missing ones' queues get emptied from
         * the back */
        const int tid = omp_get_thread_num() % threads;
        int owner;
        long item = tail_row < 0 || tail ? next_item(queues, threads, tid, &owner) : -1;
        if (item >= 0) configure_tiles(M < 16 ? M : 16);
        for (; item >= 0; item = next_item(queues, threads, tid, &owner)) {
            const ItemRange it = share_item(&shares, owner, item);
            const int g_begin = it.g_begin, g_end = it.g_end;
            if (width == 4) { /* M <= 16: one row tile against four output blocks */
                for (int g = g_begin; g < g_end; g++) {
                    const int nb0 = g * 4, nbn = NB - nb0 < 4 ? NB - nb0 : 4;
                    const uint16_t *b0 = packed + (size_t)nb0 * block_stride;
                    zero_accs();
                    for (int kb = 0; kb < KB; kb++) {
                        const uint16_t *bk = b0 + (size_t)kb * TILE;
                        if (kb + 4 < KB) /* four tiles ahead in each block's stream */
                            for (int j = 0; j < nbn; j++) prefetch_tile(bk + j * block_stride + 4 * TILE, 0);
                        _tile_loadd(4, x + kb * 32, x_stride * 2);
                        _tile_loadd(6, bk, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        /* clang-format off */
                        if (nbn > 1) { _tile_loadd(7, bk + block_stride, 64); _tile_dpbf16ps(1, 4, 7); }
                        if (nbn > 2) { _tile_loadd(6, bk + 2 * block_stride, 64); _tile_dpbf16ps(2, 4, 6); }
                        if (nbn > 3) { _tile_loadd(7, bk + 3 * block_stride, 64); _tile_dpbf16ps(3, 4, 7); }
                        /* clang-format on */
                    }
                    store_accs(acc[0]);
                    for (int j = 0; j < nbn; j++) {
                        const int n0 = (nb0 + j) * 16;
                        if (!gated) {
                            store_rows(acc[j], M, N - n0 < 16 ? N - n0 : 16, out + n0, out_stride,
                                       bias ? bias + n0 : NULL);
                        } else if (j % 2 == 0) {
                            /* blocks j, j + 1: gate and up of output columns o0 .. o0 + 15 */
                            const int o0 = (nb0 + j) / 2 * 16;
                            store_gated(acc[j], acc[j + 1], M, out + o0, out_stride, bias ? bias + o0 : NULL,
                                        bias ? bias + inter + o0 : NULL);
                        }
                    }
                }
            } else { /* groups of 2 output blocks; rows in blocks of ROW_BLOCK, chunks of 32 rows */
                /* prefill chunks: K in blocks of KB_BLOCK, so that a group's weight tiles for one K block
                 * stay in L1 across the row chunks; the accumulators go to `spill` between K blocks.
                 * (Without this both x and the weights stream from L2 for every tile product, which L2's
                 * bandwidth cannot feed.) */
                const int large = M >= LARGE_M && spill && stage;
                const int r0 = it.row_block * ROW_BLOCK, r1 = M - r0 < ROW_BLOCK ? M : r0 + ROW_BLOCK;
                const int chunks = (r1 - r0 + 31) / 32;
                for (int g = g_begin; g < g_end; g++) {
                    const int nb0 = g * 2, nbn = NB - nb0 < 2 ? NB - nb0 : 2;
                    const uint16_t *b0 = packed + (size_t)nb0 * block_stride;
                    const int n0 = nb0 * 16, cols = N - n0 < 32 ? N - n0 : 32, col = g * out_group;
                    if (large) {
                        for (int k0 = 0; k0 < KB; k0 += KB_BLOCK) {
                            const int k1 = KB - k0 < KB_BLOCK ? KB : k0 + KB_BLOCK;
                            /* the weights of the next K block, or of this item's next group, into L1
                             * while this one's chunks compute: a block's first chunk otherwise waits on
                             * them (not the next item's first: measured 2-3% slower) */
                            const int g_next = k1 < KB ? g : g + 1 < g_end ? g + 1 : -1;
                            const int kn = k1 < KB ? k1 : 0;
                            const int nbn_next = g_next < 0 ? 0 : NB - 2 * g_next < 2 ? NB - 2 * g_next : 2;
                            const int kn1 = KB - kn < KB_BLOCK ? KB : kn + KB_BLOCK;
                            BlockPrefetch bp = {g_next < 0 ? NULL
                                                           : packed + (size_t)g_next * 2 * block_stride,
                                                kn,
                                                kn1 - kn,
                                                nbn_next,
                                                block_stride,
                                                (long)chunks * (k1 - k0),
                                                0};
                            spilled_chunks(x, x_stride, tail, tail_row, K, r0, r1, spill, b0, k0, k1, nbn,
                                           block_stride, &bp, NULL);
                        }
                        /* into the staging rows, flushed to out every STAGE_GROUPS groups: a row's
                         * columns of several groups then go out as one run of lines, not one line
                         * per row and group */
                        const int slot = (g - g_begin) % STAGE_GROUPS;
                        for (int c = 0; c < chunks; c++) {
                            const int m0 = r0 + 32 * c;
                            const float *sp = spill + (size_t)c * 1024;
                            for (int t = 0; t < 2 && m0 + 16 * t < r1; t++) {
                                const int row = m0 + 16 * t, rows = r1 - row < 16 ? r1 - row : 16;
                                store_group(sp + 512 * t, sp + 512 * t + 256, rows, cols,
                                            stage + (size_t)(row - r0) * STAGE_GROUPS * 32 + slot * out_group,
                                            STAGE_GROUPS * 32, bias, col, inter, gated);
                            }
                        }
                        if (slot == STAGE_GROUPS - 1 || g == g_end - 1) {
                            const int first = (g - slot) * out_group;
                            const int width = gated ? (slot + 1) * 16 : n0 + cols - first;
                            for (int row = r0; row < r1; row++)
                                flush_row(out + (long)row * out_stride + first,
                                          stage + (size_t)(row - r0) * STAGE_GROUPS * 32, width);
                        }
                        continue;
                    }
                    /* the weights wanted next: this item's next group */
                    const int g_next = g + 1 < g_end ? g + 1 : -1;
                    Prefetch pf = {g_next >= 0 ? packed + (size_t)g_next * 2 * block_stride : NULL,
                                   g_next >= 0 ? (NB - 2 * g_next < 2 ? NB - 2 * g_next : 2) * KB : 0,
                                   (long)chunks * KB, 0, 0};
                    for (int c = 0; c < chunks; c++) {
                        const int m0 = r0 + 32 * c;
                        const RowChunk ch = row_chunk(x, x_stride, tail, tail_row, K, m0, r1);
                        zero_accs();
                        chunk_products(&ch, b0, 0, KB, nbn, block_stride, &pf);
                        store_accs(acc[0]);
                        for (int t = 0; t < 1 + ch.two; t++) {
                            const int row = m0 + 16 * t, rows = r1 - row < 16 ? r1 - row : 16;
                            store_group(acc[2 * t], acc[2 * t + 1], rows, cols,
                                        out + (long)row * out_stride + col, out_stride, bias, col, inter,
                                        gated);
                        }
                    }
                }
            }
        }
        _tile_release();
        _mm_sfence(); /* flush_row's streamed lines are visible before the caller reads out */
        free(tail);
        free(spill);
        free(stage);
    }
    free(queues);
    return failed ? -2 : 0;
}


/* ---- 4- / 8-bit weight codes on AMX (prefill-sized M) ----
 * The weights in csrc/quant_gemm.c's layout (16-row blocks of 64-byte steps; scales and zeros [blocks][G][16]
 * float32; 4-bit: step p, row j, byte i = column 8p + i (low nibble) and 8p + 4 + i (high); 8-bit: byte i =
 * column 4p + i), x already gathered to the codes' column order (act-order, group padding) as bfloat16.
 * Per thread, per 2-block group and K block, the codes are dequantized once per row block into bfloat16
 * B tiles, w = bf16((code - zero) * scale) (what a bfloat16 copy of the dequantized weight holds), which
 * the row block's chunks then multiply on the tiles as amx_linear_bf16's large-M path does; the next K
 * block's tiles are dequantized between the current one's tile products (DequantAhead), into a second
 * buffer. At M = 1-16 the VNNI kernel (quant_gemm.c), which reads the codes once and never widens them,
 * stays faster (crossover 24-32 rows, measured per shape with each path forced). */
#define QT_U4 0
#define QT_U8 1

/* Two float32 vectors (columns c, c + 1 of 16 rows) -> one B-tile row: (row n: c, c + 1) pairs, bfloat16. */
static inline void store_pair(uint16_t *dst, __m512 even, __m512 odd) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                         22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even); /* lanes 0-15 even, 16-31 odd */
    _mm512_store_si512((__m512i *)dst, _mm512_permutexvar_epi16(idx, both));
}

/* K tile kb (columns 32 kb ..) of code block nb -> one bfloat16 B tile at dst (1 KiB, 64-byte aligned).
 * Inlined once per code width (dequant_tile below) so that the shifts and the loop counts are constants:
 * 57 -> 42 ns a tile on a Xeon with AMX. */
static inline __attribute__((always_inline)) void dequant_tile_q(const uint8_t *data, const float *scales,
                                                                 const float *zeros, const int qtype,
                                                                 int k_int, int gs, int G, int nb, int kb,
                                                                 uint16_t *dst) {
    const int per_step = qtype == QT_U4 ? 8 : 4, steps = 32 / per_step;
    const uint8_t *blk = data + (size_t)nb * (k_int / per_step) * 64;
    const __m512i mask = _mm512_set1_epi32(qtype == QT_U4 ? 0xF : 0xFF);
#pragma GCC unroll 8
    for (int s = 0; s < steps; s++) {
        const int p = kb * steps + s, g = p * per_step / gs;
        const __m512i dw = _mm512_loadu_si512((const void *)(blk + (size_t)p * 64));
        const __m512 sc = _mm512_loadu_ps(scales + ((size_t)nb * G + g) * 16);
        const __m512 z = zeros ? _mm512_loadu_ps(zeros + ((size_t)nb * G + g) * 16) : _mm512_setzero_ps();
        __m512 v[8];
#pragma GCC unroll 8
        for (int o = 0; o < per_step; o++) {
            const int shift = qtype == QT_U4 ? 8 * (o & 3) + 4 * (o >> 2) : 8 * o;
            /* the top code of a lane needs no mask (GCC keeps the and otherwise) */
            const __m512i code = shift == (qtype == QT_U4 ? 28 : 24)
                                     ? _mm512_srli_epi32(dw, shift)
                                     : _mm512_and_si512(_mm512_srli_epi32(dw, shift), mask);
            v[o] = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(code), z), sc);
        }
#pragma GCC unroll 8
        for (int o = 0; o < per_step; o += 2)
            store_pair(dst + (size_t)(s * per_step + o) / 2 * 32, v[o], v[o + 1]);
    }
}
static void dequant_tile(const uint8_t *data, const float *scales, const float *zeros, int qtype, int k_int,
                         int gs, int G, int nb, int kb, uint16_t *dst) {
    if (qtype == QT_U4)
        dequant_tile_q(data, scales, zeros, QT_U4, k_int, gs, G, nb, kb, dst);
    else
        dequant_tile_q(data, scales, zeros, QT_U8, k_int, gs, G, nb, kb, dst);
}

/* One K block of a group, dequantized into a buffer laid out as a packed weight of 2 blocks of KB tiles
 * (only K tiles kb0 .. kb1 - 1 written): `tiles` = nbn * (kb1 - kb0) of them, spread evenly over `steps`
 * calls of dequant_step (Bresenham), the rest by dequant_rest. At M = 32-64 a tile's dequantization costs
 * more vector work than its 2-4 tile products take: done in one go before the products (as it was), the
 * two add up; issued between them, the vector units and the tiles work at once. */
typedef struct {
    const uint8_t *data;
    const float *scales, *zeros;
    int qtype, k_int, gs, G, KB, NB;
} Codes;
struct DequantAhead {
    const Codes *codes;
    int nb0, kb0, kb1;
    uint16_t *dst;
    long tiles, steps, acc, done;
};
/* K block k0 of group g (its 1-2 output blocks) into dst over `steps` steps; g < 0: nothing. */
static inline DequantAhead dequant_ahead(const Codes *c, int g, int k0, uint16_t *dst, long steps) {
    const int k1 = c->KB - k0 < KB_BLOCK ? c->KB : k0 + KB_BLOCK, nbn = c->NB - 2 * g < 2 ? c->NB - 2 * g : 2;
    return (DequantAhead){c, 2 * g, k0, k1, dst, g < 0 ? 0 : (long)nbn * (k1 - k0), steps, 0, 0};
}
static inline void dequant_one(DequantAhead *da) {
    const Codes *c = da->codes;
    const int per_block = da->kb1 - da->kb0, j = (int)(da->done / per_block),
              kb = da->kb0 + (int)(da->done % per_block);
    dequant_tile(c->data, c->scales, c->zeros, c->qtype, c->k_int, c->gs, c->G, da->nb0 + j, kb,
                 da->dst + ((size_t)j * c->KB + kb) * TILE);
    da->done++;
}
static inline void dequant_step(DequantAhead *da) {
    for (da->acc += da->tiles; da->acc >= da->steps && da->done < da->tiles; da->acc -= da->steps)
        dequant_one(da);
}
static inline void dequant_rest(DequantAhead *da) {
    while (da->done < da->tiles) dequant_one(da);
}

/* x [M, k_in] bfloat16 (row stride x_stride), codes as above for N outputs over k_int columns (a multiple
 * of 32), perm [k_int] int64 (the input column of each code column, -1 or past k_in: zero) or NULL (column c
 * reads input c below k_in), bias [N] or NULL, out [M, N]. Returns 0, -1 for an unsupported shape or
 * type, -2 when scratch cannot be had. */
int amx_linear_quant(const uint16_t *x, long x_stride, int k_in, const int64_t *perm, const uint8_t *data,
                     const float *scales, const float *zeros, int qtype, int k_int, int gs,
                     const uint16_t *bias, uint16_t *out, long out_stride, int M, int N, int num_threads) {
    if ((qtype != QT_U4 && qtype != QT_U8) || k_int % 32 || k_int <= 0 || gs <= 0 || k_int % gs
        || gs % (qtype == QT_U4 ? 8 : 4))
        return -1;
    if (M <= 0 || N <= 0) return 0;
    const int NB = (N + 15) / 16, KB = k_int / 32, G = k_int / gs, groups = (NB + 1) / 2;
    int failed = 0;
    /* the activations in the codes' column order, once for both threads (act-order, padded groups) */
    uint16_t *gathered = NULL;
    if (perm || k_in != k_int) {
        gathered = (uint16_t *)aligned_alloc(64, ((size_t)M * k_int * 2 + 63) / 64 * 64);
        int32_t *cols = (int32_t *)malloc(sizeof(int32_t) * (size_t)k_int);
        if (!gathered || !cols) {
            free(gathered);
            free(cols);
            return -2;
        }
        for (int c = 0; c < k_int; c++) { /* each code column's input column, -1: reads zero */
            const int64_t src = perm ? perm[c] : c;
            cols[c] = src >= 0 && src < k_in ? (int32_t)src : -1;
        }
        /* 16 columns a vpgatherdd (a scalar loop took ~3 ns a value: act-order cost a 2,048-row GEMM
         * 26-43% more than the same weight without it): each lane reads the 4 bytes at its value, of
         * which the low 2 are it. The 2 after a row's last value belong to the next row (or its padding),
         * so the last row, whose 2 may lie past x, is read one value at a time. */
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int r = 0; r < M; r++) {
            const uint16_t *xr = x + (long)r * x_stride;
            uint16_t *gr = gathered + (size_t)r * k_int;
            int c = 0;
            if (r + 1 < M)
                for (; c + 16 <= k_int; c += 16) {
                    const __m512i idx = _mm512_loadu_si512((const void *)(cols + c));
                    const __mmask16 valid = _mm512_cmpge_epi32_mask(idx, _mm512_setzero_si512());
                    const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, idx, xr, 2);
                    _mm256_storeu_si256((__m256i *)(gr + c), _mm512_cvtepi32_epi16(v));
                }
            for (; c < k_int; c++) gr[c] = cols[c] >= 0 ? xr[cols[c]] : 0;
        }
        free(cols);
        x = gathered;
        x_stride = k_int;
    }
    /* the threads' shares and queues, as in amx_linear_bf16 */
    const int threads = num_threads > 0 ? num_threads : 1;
    const Shares shares = plan_shares(groups, threads, (M + ROW_BLOCK - 1) / ROW_BLOCK, M >= LARGE_M);
    long *queues = share_queues(&shares);
    if (!queues) {
        free(gathered);
        return -2;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num() % threads;
        float *spill = (float *)aligned_alloc(64, (size_t)(ROW_BLOCK / 32) * 1024 * sizeof(float));
        /* two buffers of dequantized B tiles, each laid out as a packed weight of 2 blocks (only one K
         * block's tiles live): the current K block's, and the next one's being written */
        uint16_t *btiles = (uint16_t *)aligned_alloc(64, (size_t)2 * 2 * KB * TILE * 2);
        const int tail_row = tail_row_of(M);
        uint16_t *tail = tail_row >= 0 ? copy_tail(x, x_stride, tail_row, M, k_int) : NULL;
        int owner = tid;
        long item = -1;
        if (!spill || !btiles || (tail_row >= 0 && !tail)) {
#pragma omp atomic write
            failed = 1;
        } else if ((item = next_item(queues, threads, tid, &owner)) >= 0) {
            configure_tiles(M < 16 ? M : 16);
        }
        const Codes codes = {data, scales, zeros, qtype, k_int, gs, G, KB, NB};
        uint16_t *const bufs[2] = {btiles, btiles + (size_t)2 * KB * TILE};
        int buf = 0; /* the buffer holding the current K block */
        for (; item >= 0; item = next_item(queues, threads, tid, &owner)) {
            const ItemRange it = share_item(&shares, owner, item);
            const int g_begin = it.g_begin, g_end = it.g_end;
            /* an item's first K block here; each later one while its predecessor's products run */
            DequantAhead first = dequant_ahead(&codes, g_begin, 0, bufs[buf], 1);
            dequant_rest(&first);
            const int r0 = it.row_block * ROW_BLOCK, r1 = M - r0 < ROW_BLOCK ? M : r0 + ROW_BLOCK;
            const int chunks = (r1 - r0 + 31) / 32;
            for (int g = g_begin; g < g_end; g++) {
                const int nb0 = g * 2, nbn = NB - nb0 < 2 ? NB - nb0 : 2;
                for (int k0 = 0; k0 < KB; k0 += KB_BLOCK) {
                    const int k1 = KB - k0 < KB_BLOCK ? KB : k0 + KB_BLOCK;
                    /* the block after this one: the group's next K block or the item's next group's
                     * first */
                    const int g_next = k1 < KB ? g : g + 1 < g_end ? g + 1 : -1;
                    DequantAhead ahead = dequant_ahead(&codes, g_next, k1 < KB ? k1 : 0, bufs[buf ^ 1],
                                                       (long)chunks * (k1 - k0));
                    spilled_chunks(x, x_stride, tail, tail_row, k_int, r0, r1, spill, bufs[buf], k0, k1, nbn,
                                   (size_t)KB * TILE, NULL, &ahead);
                    dequant_rest(&ahead);
                    buf ^= 1;
                }
                const int n0 = nb0 * 16, cols = N - n0 < 32 ? N - n0 : 32;
                for (int c = 0; c < chunks; c++)
                    for (int t = 0; t < 2; t++) {
                        const int row = r0 + 32 * c + 16 * t;
                        if (row >= r1) break;
                        const int rows = r1 - row < 16 ? r1 - row : 16;
                        const float *sp = spill + (size_t)c * 1024 + 512 * t;
                        store_rows2(sp, sp + 256, rows, cols, out + (long)row * out_stride + n0, out_stride,
                                    bias ? bias + n0 : NULL);
                    }
            }
        }
        _tile_release();
        free(tail);
        free(spill);
        free(btiles);
    }
    free(queues);
    free(gathered);
    return failed ? -2 : 0;
}

#else /* no AMX in this build: callers keep oneDNN */
int amx_available(void) { return 0; }
/* clang-format off */
size_t amx_packed_size(int N, int K) { (void)N; (void)K; return 0; }
void amx_pack_bf16(const uint16_t *w, uint16_t *packed, int N, int K) {
    (void)w; (void)packed; (void)N; (void)K;
}
void amx_pack_bf16_gated(const uint16_t *w, uint16_t *packed, int N, int K) {
    amx_pack_bf16(w, packed, N, K);
}
int amx_linear_bf16(const uint16_t *x, long x_stride, const uint16_t *packed, const uint16_t *bias,
                    uint16_t *out, long out_stride, int M, int N, int K, int num_threads, int gated) {
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)out; (void)out_stride; (void)M; (void)N; (void)K;
    (void)num_threads; (void)gated;
    return -3;
}
int amx_linear_quant(const uint16_t *x, long x_stride, int k_in, const int64_t *perm, const uint8_t *data,
                     const float *scales, const float *zeros, int qtype, int k_int, int gs, const uint16_t *bias,
                     uint16_t *out, long out_stride, int M, int N, int num_threads) {
    (void)x; (void)x_stride; (void)k_in; (void)perm; (void)data; (void)scales; (void)zeros; (void)qtype; (void)k_int; (void)gs;
    (void)bias; (void)out; (void)out_stride; (void)M; (void)N; (void)num_threads;
    return -3;
}
/* clang-format on */
#endif
