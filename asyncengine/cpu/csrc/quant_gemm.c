/* Weight-only quantized GEMM: out = x W^T + b with W held as 4-bit / 8-bit codes or float8 e4m3,
 * dequantized in registers (never a whole weight per call); also plain bfloat16 weights (QT_BF16, scales
 * one and no zeros), for CPUs without AMX, where this kernel's tiles beat oneDNN at decode sizes.
 *
 * Weight layout (cpu/quant_gemm.py packs it): output rows in blocks of 16 (one float32 vector), each
 * block a run of 64-byte steps, 4 bytes a row (the operand of vpdpbusd and vdpbf16ps as it is):
 *   4-bit: step p, row j, byte i: column 8p + i (low nibble), 8p + 4 + i (high) -> [blocks][K / 8][16][4]
 *   8-bit: step p, row j, byte i: column 4p + i                               -> [blocks][K / 4][16][4]
 *   bfloat16: step p, row j: the pair (column 2p, column 2p + 1)               -> [blocks][K / 2][16][2]
 *   e4m3: step k holds column k of the 16 rows, 16 bytes                       -> [blocks][K][16]
 * (the packer pads each group to whole steps: 8 columns for 4-bit codes, 4 for 8-bit).
 * scales and zeros: [blocks][G][16] float32, group g covering columns [g * gs, (g + 1) * gs).
 * w = (code - zero) * scale; e4m3 is widened to half precision (a shift) and converted by vcvtph2ps,
 * which yields w / 256: the packer stores scale * 256 for it (exact: a power of two).
 *
 * bfloat16 activations and 4-/8-bit codes with AVX512-VNNI (qgemm_i8, unless the weight was packed
 * without it): the activations are quantized to int8 per row and block of 32 columns (scale max|x| / 127,
 * as llama.cpp's Q8_0) and vpdpbusd multiplies them with the raw codes, 64 products an instruction,
 * exact in int32; each block's sum is scaled once and each group's zero applied once. About 2 instructions
 * per 64 weights, where widening codes to bfloat16 costs 6-8 per 32: single-stream decode is bound by
 * reading the codes again, not by arithmetic. The activations' rounding (up to half a step of
 * max|x| / 127 per value) is the price; ASYNCENGINE_CPU_INT8_ACTIVATIONS=0 keeps the exact path below.
 * bfloat16 activations with AVX512-BF16 (qgemm_bf16): gathered through `perm` (act-order; -1 reads zero)
 * as bfloat16 with per-group sums; vdpbf16ps multiplies raw codes (exact in bfloat16) into MT-row tiles
 * and each group's zero and scale are applied once per group: about 5 instructions per 32 weights
 * plus one per row, where the float32 path below spends 11 plus two per row.
 * Otherwise (float32 activations, or no AVX512-BF16): activations are widened to float32, gathered and
 * zero-padded to K (one pass, m * K floats); decode-sized M (<= MT rows) dequantizes each 16-value step
 * in registers as (code - zero) * scale, the reference's float32 weight exactly, and multiplies it into
 * every row at once; larger M dequantizes a block's whole strip ([K][16] float32, L2-sized) once and
 * runs MT-row tiles over it. Output blocks are split across OpenMP threads.
 * A [gate | up] bfloat16 or float32 weight packed gated (qgemm_bf16_gated, qgemm_f32_gated) alternates gate
 * and up blocks, and its tiles' epilogue writes silu(gate) * up (DEFINE_GATED_WEIGHTS).
 * Each output value is summed over k in one fixed order, whatever M is. Built by cpu/build.py. */
#include <omp.h>
#include <stdlib.h>

#include "cpu_common.h"

#define QT_U4 0
#define QT_U8 1
#define QT_FP8 2
#define QT_BF16 3
#define QT_F32 4
#define MT 8
#define NB_MAX 3 /* blocks of a tile: NB_MAX x MT = 24 accumulators */
#define PREFETCH_AHEAD 1024 /* bytes: ~16 steps ahead of the loads */
#define PAR_MIN (1L << 16) /* multiply-adds below which waking threads costs more than it saves */


/* bytes a block (16 rows) holds per column: half a byte, one or two bytes a row */
static inline long column_bytes(int qtype) {
    return qtype == QT_U4 ? 8 : qtype == QT_BF16 ? 32 : qtype == QT_F32 ? 64 : 16;
}

/* How far ahead of offset `off` of a tile's block to prefetch: PREFETCH_AHEAD bytes, but from a block's
 * last KiB the same place in the next tile's block (nb blocks on, most often this thread's next tile), so
 * each stream of the next tile starts warm instead of with a KiB of misses (a 4-bit decode tile's block
 * is 6 KiB at K = 768). */
static inline long ahead_of(long off, long bstride, int nb) {
    return off + PREFETCH_AHEAD < bstride ? PREFETCH_AHEAD : PREFETCH_AHEAD + (long)(nb - 1) * bstride;
}

/* Tile t of nb_max blocks (the last may be narrower): its first block, width, weights, scales, zeros. */
typedef struct {
    int b0, nb;
    const uint8_t *wb;
    const float *sb, *zb;
} Tile;

static inline Tile tile_at(int t, int nb_max, int blocks, const uint8_t *w, long bstride, const float *scales,
                           const float *zeros, long sstride) {
    const int b0 = t * nb_max;
    return (Tile){b0, blocks - b0 < nb_max ? blocks - b0 : nb_max, w + b0 * bstride, scales + b0 * sstride,
                  zeros ? zeros + b0 * sstride : 0};
}

/* bytes of one block's weights (16 rows, all k_int columns) */
long qgemm_step_bytes(int k_int, int qtype) { return (long)k_int * column_bytes(qtype); }

/* activations [m, k_int] float32: widened, permuted, zero-padded */
static void gather_x(const void *x, long x_stride, int x_bf16, int k_in, const long *perm, float *xs, int m,
                     int k_int) {
    for (int r = 0; r < m; r++) {
        float *dst = xs + (long)r * k_int;
        for (int k = 0; k < k_int; k++) {
            const long src = perm ? perm[k] : (k < k_in ? k : -1);
            if (src < 0)
                dst[k] = 0.0f;
            else if (x_bf16)
                dst[k] = bf16_to_f32(((const uint16_t *)x)[(long)r * x_stride + src]);
            else
                dst[k] = ((const float *)x)[(long)r * x_stride + src];
        }
    }
}

/* out[r, col] = acc + bias, rounded to the output dtype once */
static inline void store_value(void *out, long out_stride, int out_bf16, int r, int col, float v,
                               const void *bias) {
    if (bias) v += out_bf16 ? bf16_to_f32(((const uint16_t *)bias)[col]) : ((const float *)bias)[col];
    if (out_bf16)
        ((uint16_t *)out)[(long)r * out_stride + col] = f32_to_bf16(v);
    else
        ((float *)out)[(long)r * out_stride + col] = v;
}

static inline float e4m3_to_f32_over_256(uint8_t b) {
    /* the half with e4m3's exponent and mantissa bits: value / 256 (see the header comment) */
    const uint16_t h = (uint16_t)(((b & 0x7f) << 7) | ((b & 0x80) << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float f;
    if (!exp) {
        f = (float)man * 5.9604644775390625e-08f; /* 2^-24 */
        return sign ? -f : f;
    }
    const uint32_t u = sign | ((exp + 112) << 23) | (man << 13);
    memcpy(&f, &u, 4);
    return f;
}

/* The dequantized weights of one block's step k (16 output rows) into w[16], portable C. */
static inline void dequant_step(const uint8_t *wb, int k, int qtype, const float *s, const float *z, float *w) {
    if (qtype == QT_U4) {
        const uint8_t *p = wb + (long)(k >> 3) * 64 + (k & 3);
        const int shift = (k & 4); /* columns 8p + 4 .. 8p + 7: the high nibbles */
        for (int j = 0; j < 16; j++) w[j] = ((float)((p[4 * j] >> shift) & 15) - z[j]) * s[j];
    } else if (qtype == QT_U8) {
        const uint8_t *p = wb + (long)(k >> 2) * 64 + (k & 3);
        for (int j = 0; j < 16; j++) w[j] = ((float)p[4 * j] - z[j]) * s[j];
    } else if (qtype == QT_BF16) {
        const uint16_t *p = (const uint16_t *)wb + (long)(k >> 1) * 32 + (k & 1);
        for (int j = 0; j < 16; j++) w[j] = bf16_to_f32(p[2 * j]) * s[j];
    } else {
        const uint8_t *p = wb + (long)k * 16;
        for (int j = 0; j < 16; j++) w[j] = e4m3_to_f32_over_256(p[j]) * s[j];
    }
}

static const float ZERO16[16];

#ifdef HAVE_AVX512
/* 16 e4m3 bytes -> 16 float32 values / 256 */
static inline __m512 e4m3x16(const uint8_t *p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    return _mm512_cvtph_ps(h);
}

/* rows (<= MT) activation rows against one block, weights dequantized in registers. Inlined with a
 * constant `rows`, so the row loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_direct(int rows, const float *xs, int k_int, int gs,
                                                               int qtype, const uint8_t *wb, const float *sb,
                                                               const float *zb, __m512 *acc) {
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const int groups = k_int / gs;
    for (int g = 0; g < groups; g++) {
        const __m512 s = _mm512_loadu_ps(sb + g * 16);
        const __m512 z = zb ? _mm512_loadu_ps(zb + g * 16) : _mm512_setzero_ps();
        const int k0 = g * gs, k1 = k0 + gs;
        if (qtype == QT_U4 || qtype == QT_U8) { /* a 64-byte step: 8 (4-bit) or 4 (8-bit) columns */
            const int cols = qtype == QT_U4 ? 8 : 4;
            for (int k = k0; k < k1; k += cols) {
                const uint8_t *p = wb + (long)(k >> (qtype == QT_U4 ? 3 : 2)) * 64;
                _mm_prefetch((const char *)(p + 1024), _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512(p);
                for (int c = 0; c < cols; c++) { /* column k + c, in k's order */
                    const int shift = 8 * (c & 3) + (c & 4);
                    const __m512i code = _mm512_and_si512(_mm512_srli_epi32(v, shift),
                                                          _mm512_set1_epi32(qtype == QT_U4 ? 15 : 255));
                    const __m512 w = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(code), z), s);
                    for (int r = 0; r < rows; r++)
                        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[(long)r * k_int + k + c]), w, acc[r]);
                }
            }
        } else if (qtype == QT_BF16) {
            for (int k = k0; k < k1; k += 2) {
                const uint8_t *p = wb + (long)k * 32;
                _mm_prefetch((const char *)(p + 1024), _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512(p); /* lane j: (column k, column k + 1) of row j */
                const __m512 w0 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), s);
                const __m512 w1 =
                    _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000))), s);
                for (int r = 0; r < rows; r++) {
                    const float *xr = xs + (long)r * k_int + k;
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), w0, acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), w1, acc[r]);
                }
            }
        } else { /* e4m3 */
            for (int k = k0; k < k1; k++) {
                const uint8_t *p = wb + (long)k * 16;
                _mm_prefetch((const char *)(p + 1024), _MM_HINT_T0);
                const __m512 w = _mm512_mul_ps(e4m3x16(p), s);
                for (int r = 0; r < rows; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[(long)r * k_int + k]), w, acc[r]);
            }
        }
    }
}

/* rows (<= MT) activation rows against a block's dequantized strip [k_int][16] */
static inline __attribute__((always_inline)) void block_strip(int rows, const float *xs, int k_int,
                                                              const float *strip, __m512 *acc) {
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int k = 0; k < k_int; k++) {
        const __m512 w = _mm512_load_ps(strip + (long)k * 16);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[(long)r * k_int + k]), w, acc[r]);
    }
}

#define ROWS_SWITCH(CALL)                                                                                  \
    switch (rows) {                                                                                        \
    case 1: CALL(1); break;                                                                                \
    case 2: CALL(2); break;                                                                                \
    case 3: CALL(3); break;                                                                                \
    case 4: CALL(4); break;                                                                                \
    case 5: CALL(5); break;                                                                                \
    case 6: CALL(6); break;                                                                                \
    case 7: CALL(7); break;                                                                                \
    default: CALL(8); break;                                                                               \
    }

/* ROWS_SWITCH for a CALL(rows, ...) that takes more arguments: the plain and gated tile loops' TILE */
#define ROWS_SWITCH_ARGS(CALL, ...)                                                                        \
    switch (rows) {                                                                                        \
    case 1: CALL(1, __VA_ARGS__); break;                                                                   \
    case 2: CALL(2, __VA_ARGS__); break;                                                                   \
    case 3: CALL(3, __VA_ARGS__); break;                                                                   \
    case 4: CALL(4, __VA_ARGS__); break;                                                                   \
    case 5: CALL(5, __VA_ARGS__); break;                                                                   \
    case 6: CALL(6, __VA_ARGS__); break;                                                                   \
    case 7: CALL(7, __VA_ARGS__); break;                                                                   \
    default: CALL(8, __VA_ARGS__); break;                                                                  \
    }

/* CALL(A, B, qtype) with qtype a constant (the code type's loops unroll with immediate shifts) */
#define QTYPE_SWITCH(CALL, A, B)                                                                           \
    do {                                                                                                   \
        if (qtype == QT_U4)                                                                                \
            CALL(A, B, QT_U4);                                                                             \
        else if (qtype == QT_U8)                                                                           \
            CALL(A, B, QT_U8);                                                                             \
        else                                                                                               \
            CALL(A, B, QT_FP8);                                                                            \
    } while (0)

/* Asks for the output lines a tile will store (rows r0 .. r0 + rows - 1, columns col .. col + cols - 1 of
 * esz bytes) in the writable state before the tile's k loop, so that the stores at its end find them in the
 * caches instead of each waiting for a read-for-ownership from DRAM: a prefill GEMM's output is far past
 * L2, and a bfloat16 tile's 96 bytes a row even share a line with the next tile's, written a whole panel
 * of row tiles later; a decode step's LM head writes [batch, vocab]. The tile's multiply-adds hide the
 * fetches. Measured (bfloat16, AMD Zen 4, 2 threads, best of 18, builds alternated; outputs bit-identical):
 * medium's qkv at M = 2048 426-439 -> 444-450 GF/s, o, gate/up and down +0.5-2% (without any store at all:
 * qkv 458); Qwen2.5-0.5B's qkv +3% and its 151,936-row LM head 434 -> 449 at M = 2048, 421 -> 444 at M = 64
 * (weights cycled from DRAM); M = 1-16 level within the noise, M = 128-512 level. */
static inline void prefetch_out_rows(const void *out, long out_stride, int esz, int r0, int rows, long col,
                                     long cols) {
    for (int r = 0; r < rows; r++) {
        const char *row = (const char *)out + ((long)(r0 + r) * out_stride + col) * esz;
        for (uintptr_t line = (uintptr_t)row & ~(uintptr_t)63; line < (uintptr_t)(row + cols * esz); line += 64)
            __builtin_prefetch((const void *)line, 1, 3);
    }
}

/* The kernels' output policies: OUTP##_BEFORE a tile's k loop, OUTP##_DONE after a thread's share. Macros
 * rather than flags: even a dead `if (0)` call changes the outlined OpenMP body's register allocation, and
 * the tile loops are that sensitive (3-4%).
 * - bfloat16 (plain and gated): the output lines prefetched for writing, above.
 * - float32, a prefill's output: non-temporal stores (no read-for-ownership; a float32 tile's 16-column
 *   block of a row is one whole line where it is aligned, so nothing is merged), every row from
 *   STREAM_MIN_ROWS on (store16_f32, for store_tile and store_gated_f32 alike), so that a decode step's or
 *   a short prefill's output stays in the caches for the next op. Each thread ends its share with an
 *   sfence (OUTP##_DONE; qgemm's float32-activation region too), so that the streamed lines are visible
 *   after the parallel region. Measured (AMD Zen 4, 2
 *   threads, medium's shapes, best of 18, builds alternated; outputs bit-identical): M = 2048 qkv 216-218
 *   -> 223-224 GF/s, o 215-219 -> 224-225, down 216-222 -> 218-225, gate/up 209 -> 213; M = 256-512 level
 *   to +1.5%; M <= 64 (nothing streamed) level. The float32 prefetch for writing measured 1.5-3% slower. */
#define OUT_BF16_ROWS_BEFORE(...) prefetch_out_rows(__VA_ARGS__)
#define OUT_BF16_ROWS_DONE()
#define OUT_F32_ROWS_BEFORE(...)
#define OUT_F32_ROWS_DONE() _mm_sfence()
#define STREAM_MIN_ROWS 256
/* One float32 block row of output row `row`: streamed from row STREAM_MIN_ROWS on where dst is a whole
 * aligned line, else a plain store (store_tile and store_gated_f32 alike). */
static inline void store16_f32(float *dst, int row, __m512 v) {
    if (row >= STREAM_MIN_ROWS && !((uintptr_t)dst & 63))
        _mm512_stream_ps(dst, v);
    else
        _mm512_storeu_ps(dst, v);
}

static void store_tile(const __m512 *acc, int rows, int r0, int col0, int n, void *out, long out_stride,
                       int out_bf16, const void *bias) {
    float tmp[16];
    const int width = n - col0 < 16 ? n - col0 : 16;
    if (!out_bf16 && width == 16) { /* a whole float32 block: vector stores */
        const __m512 b = bias ? _mm512_loadu_ps((const float *)bias + col0) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            float *dst = (float *)out + (long)(r0 + r) * out_stride + col0;
            store16_f32(dst, r0 + r, bias ? _mm512_add_ps(acc[r], b) : acc[r]);
        }
        return;
    }
    if (out_bf16 && width == 16) { /* a whole block: vector stores */
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)bias + col0))), 16))
                              : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 v = bias ? _mm512_add_ps(acc[r], b) : acc[r];
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + (long)(r0 + r) * out_stride + col0), bf16_pack(v));
        }
        return;
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(tmp, acc[r]);
        for (int j = 0; j < width; j++) store_value(out, out_stride, out_bf16, r0 + r, col0 + j, tmp[j], bias);
    }
}

/* A thread's share of a tiled GEMM: output blocks in tiles of up to nb_max (tile t: blocks t * nb_max on),
 * each tile's rows in row tiles, the work run tile by tile so that a tile's weight panel is read once for
 * all its rows. Thread th of nt takes the stretch [th C / nt, (th + 1) C / nt) of it, C = blocks x m
 * block-rows, cut at a multiple of `gran` rows inside a tile: a tile may be shared by two threads (each
 * reads its panel), and the threads' shares differ by at most gran rows of one tile. `omp for` over whole
 * tiles left a thread a tile more whenever the tiles did not divide evenly: 896 outputs are 19 tiles, 10
 * against 9 on two threads (5-7% off that GEMM, measured at M = 2048), 2 against 1 on sixteen. Where m is
 * gran rows or fewer there is no row to cut at, so the blocks are split instead (a thread's tiles start at
 * its first block, its last one perhaps narrower). Which thread computes an output never changes its sum. */
typedef struct {
    int b_begin, b_end; /* the thread's blocks, in tiles of nb_max from b_begin */
    int r_first, r_last; /* its first tile from row r_first, its last up to row r_last */
} Share;

/* The (tile, row) where `cost` block-rows of the tile-by-tile order end, row a multiple of gran below m. */
static inline void cut_at(long cost, int blocks, int nb_max, int m, int gran, int *tile, int *row) {
    const int full_tiles = blocks / nb_max;
    const long full = (long)nb_max * m;
    long t = cost / full;
    if (t > full_tiles) t = full_tiles;
    const int nb = t < full_tiles ? nb_max : blocks - full_tiles * nb_max; /* tile t's width */
    long r = nb ? (cost - t * full + nb - 1) / nb : 0;
    r = (r + gran - 1) / gran * gran;
    if (r >= m) t++, r = 0;
    *tile = (int)t;
    *row = (int)r;
}

static inline Share thread_share(int blocks, int nb_max, int m, int gran, int th, int nt) {
    if (nt <= 1) return (Share){0, blocks, 0, m};
    if (m <= gran) return (Share){(int)((long)blocks * th / nt), (int)((long)blocks * (th + 1) / nt), 0, m};
    const long total = (long)blocks * m;
    int t0, r0, t1, r1;
    cut_at(total * th / nt, blocks, nb_max, m, gran, &t0, &r0);
    cut_at(total * (th + 1) / nt, blocks, nb_max, m, gran, &t1, &r1);
    const int last = r1 ? t1 : t1 - 1; /* the last tile it touches */
    const long b_end = (long)(last + 1) * nb_max;
    if (last < t0) return (Share){0, 0, 0, 0};
    return (Share){t0 * nb_max, b_end < blocks ? (int)b_end : blocks, r0, r1 ? r1 : m};
}

/* Decode-sized batches (2 to NEXT_PANEL_MAX_TILES row tiles) prefetch the next weight panel: a tile's first
 * row tile streams its panel from DRAM, ahead of its loads by only PREFETCH_AHEAD (~30 GB/s a core, where its
 * arithmetic would take ~70), while the later row tiles read it from L2 with the memory bus idle. So each
 * later row tile fetches a share of the next panel (into L2, spread over its k steps), and the next tile's
 * first row tile finds it there. Measured (bfloat16, medium's shapes, 2 threads, AMD Zen 5, 12 layers'
 * weights cycled): M = 16 qkv 825 -> 911, gate/up 673 -> 801, lm_head 686 -> 814 GF/s; M = 64 962 -> 1026,
 * 884 -> 956, 952 -> 1037; M = 128 +3%; from M = 256 level, and past 16 row tiles the stall is a small
 * share of a panel's time, so larger batches keep the plain loop.
 * On AMD Zen 4 (CPU_ZEN4: half Zen 5's arithmetic rate, so a row tile takes twice as long against the same
 * bus) the first row tile fetches a share too. Measured there (bfloat16,
 * medium's qkv, gated gate/up, down and LM head, 2 threads, weights cycled over ~400 MB, best of 5, the two
 * builds alternated four times), GF/s summed over the four shapes: M = 12 1,060-1,164 -> 1,150-1,220 (+6%),
 * M = 16 1,302-1,355 -> 1,282-1,379 (level); M = 24-64 level in an earlier pass. */
#define NEXT_PANEL_MAX_TILES 16
#ifndef FIRST_TILE_SHARES
#define FIRST_TILE_SHARES CPU_ZEN4 /* cpu_common.h */
#endif
typedef struct {
    const char *p;
    long lines;
} Span; /* 64-byte lines to prefetch */
/* Row tile i of `tiles` over one weight panel: its share of the next panel (next, bytes) to prefetch. */
static inline Span next_share(const uint8_t *next, long bytes, int i, int tiles) {
    const int sharers = FIRST_TILE_SHARES ? tiles : tiles - 1, k = FIRST_TILE_SHARES ? i : i - 1;
    if (!next || tiles < 2 || tiles > NEXT_PANEL_MAX_TILES || k < 0) return (Span){0, 0};
    const long lines = (bytes + 63) / 64, per = (lines + sharers - 1) / sharers, first = k * per;
    return (Span){(const char *)next + first * 64, first >= lines ? 0 : lines - first < per ? lines - first : per};
}

/* float32 weights (QT_F32, cpu/quant_gemm.py pack_f32: [blocks][K][16], one 64-byte step a column) against
 * float32 activations read in place: tile_bf16's tiles with FMAs, NB_MAX blocks x MT rows (24 accumulators),
 * one weight vector per block and k feeding MT rows, one broadcast per row feeding NB_MAX blocks; the same
 * prefetches (PREFETCH_AHEAD within the panel, a share of the next panel at decode-sized M). Each output
 * sums over k in order. Against oneDNN's float32 GEMM on its own blocked weights (`python
 * bench/quant_gemm.py --float32 --threads 2`, medium's shapes, AMD Zen 5): M = 1 0.91-1.02x (both stream
 * the weight), M = 8 1.08-1.35x, M = 64 1.10-1.15x, M = 128 1.03-1.08x, M = 512-2048 1.00-1.06x. */
static inline __attribute__((always_inline)) void tile_f32(int rows, int nb, const float *x, long x_stride,
                                                           int k_int, const uint8_t *wb, long bstride, __m512 *acc,
                                                           Span pf) {
    for (int i = 0; i < nb * MT; i++) acc[i] = _mm512_setzero_ps();
    const long pf_per = pf.lines > 0 ? (pf.lines + k_int - 1) / k_int : 0; /* lines a k step */
    long pf_line = 0;
    for (int k = 0; k < k_int; k++) {
        for (long i = 0; i < pf_per && pf_line < pf.lines; i++, pf_line++)
            _mm_prefetch(pf.p + pf_line * 64, _MM_HINT_T1);
        __m512 w[4]; /* nb <= 4: the gated kernel's two pairs */
        const long off = (long)k * 64, ahead = ahead_of(off, bstride, nb);
        for (int j = 0; j < nb; j++) {
            const uint8_t *p = wb + j * bstride + off;
            w[j] = _mm512_loadu_ps(p);
            KEEP_IN_REGISTER(w[j]);
            _mm_prefetch((const char *)(p + ahead), _MM_HINT_T0);
        }
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_set1_ps(x[(long)r * x_stride + k]);
            for (int j = 0; j < nb; j++) acc[j * MT + r] = _mm512_fmadd_ps(w[j], xv, acc[j * MT + r]);
        }
    }
}

/* Plain (bfloat16 or float32) weights, out = x W^T + b: tiles of NB_MAX blocks (the last tile narrower) x MT
 * rows through TILE(rows, nb, x, wb, acc, pf) (tile_bf16 / tile_f32 with the function's x_stride, k_int
 * and bstride), split over the threads by thread_share; at decode-sized M each later row tile prefetches a
 * share of the thread's next tile's panel (next_share). XT: the activations' element type; OUT_BF16: the
 * output's; OUTP: the output policy (OUT_BF16_ROWS, OUT_F32_ROWS). */
#define DEFINE_PLAIN_WEIGHTS(NAME, TILE, XT, QTYPE, OUT_BF16, OUTP)                                        \
    static int NAME(const void *x, long x_stride, const uint8_t *w, const void *bias, void *out,             \
                    long out_stride, int m, int n, int k_int, int num_threads) {                              \
        const int blocks = (n + 15) / 16;                                                                   \
        const long bstride = qgemm_step_bytes(k_int, QTYPE);                                               \
        _Pragma("omp parallel num_threads(num_threads) if ((long)m * n * k_int >= PAR_MIN && blocks > 1)")  \
        {                                                                                                   \
            const Share s = thread_share(blocks, NB_MAX, m, MT, omp_get_thread_num(), omp_get_num_threads()); \
            __m512 acc[NB_MAX * MT];                                                                        \
            for (int b0 = s.b_begin; b0 < s.b_end; b0 += NB_MAX) {                                          \
                const int nb = s.b_end - b0 < NB_MAX ? s.b_end - b0 : NB_MAX;                              \
                const int left = s.b_end - b0 - nb, nb1 = left < NB_MAX ? left : NB_MAX; /* next tile's */ \
                const uint8_t *next = nb1 > 0 ? w + (long)(b0 + nb) * bstride : NULL;                      \
                const int r_begin = b0 == s.b_begin ? s.r_first : 0, r_end = left ? m : s.r_last;          \
                const int row_tiles = (r_end - r_begin + MT - 1) / MT;                                      \
                const uint8_t *wb = w + (long)b0 * bstride;                                                 \
                for (int r0 = r_begin; r0 < r_end; r0 += MT) {                                              \
                    const int rows = r_end - r0 < MT ? r_end - r0 : MT;                                     \
                    const Span pf = next_share(next, (long)nb1 * bstride, (r0 - r_begin) / MT, row_tiles);  \
                    const XT *xr = (const XT *)x + (long)r0 * x_stride;                                     \
                    OUTP##_BEFORE(out, out_stride, OUT_BF16 ? 2 : 4, r0, rows, 16L * b0, 16L * nb);        \
                    if (nb == 3) {                                                                          \
                        ROWS_SWITCH_ARGS(TILE, 3, xr, wb, acc, pf)                                          \
                    } else if (nb == 2) {                                                                   \
                        ROWS_SWITCH_ARGS(TILE, 2, xr, wb, acc, pf)                                          \
                    } else {                                                                                \
                        ROWS_SWITCH_ARGS(TILE, 1, xr, wb, acc, pf)                                          \
                    }                                                                                       \
                    for (int j = 0; j < nb; j++)                                                            \
                        store_tile(acc + j * MT, rows, r0, (b0 + j) * 16, n, out, out_stride, OUT_BF16, bias); \
                }                                                                                           \
            }                                                                                               \
            OUTP##_DONE();                                                                                  \
        }                                                                                                   \
        return 0;                                                                                           \
    }
#define F32_TILE(R, NB, X, WB, ACC, PF) tile_f32(R, NB, X, x_stride, k_int, WB, bstride, ACC, PF)
DEFINE_PLAIN_WEIGHTS(f32_weights, F32_TILE, float, QT_F32, 0, OUT_F32_ROWS)

/* `rows` rows of a gate and an up accumulator block (+ their biases) -> 16 float32 columns of silu(g) * u:
 * cpu_ops.c's silu_and_mul on the plain kernel's output (store_tile: acc + bias), bit for bit. */
__attribute__((noinline)) static void store_gated_f32(const __m512 *acc_g, const __m512 *acc_u, int rows, int r0,
                                                      int col, float *out, long out_stride, const float *bias_g,
                                                      const float *bias_u) {
    for (int r = 0; r < rows; r++) {
        const __m512 g = bias_g ? _mm512_add_ps(acc_g[r], _mm512_loadu_ps(bias_g)) : acc_g[r];
        const __m512 u = bias_u ? _mm512_add_ps(acc_u[r], _mm512_loadu_ps(bias_u)) : acc_u[r];
        const __m512 a = _mm512_div_ps(
            g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store16_f32(out + (long)(r0 + r) * out_stride + col, r0 + r, _mm512_mul_ps(a, u));
    }
}

/* A [gate | up] weight packed gated (cpu/quant_gemm.py pack_bf16 / pack_f32 with gated=True): its blocks
 * alternate gate and up (block 2i: gate rows 16i .. 16i + 15, block 2i + 1: the up rows of the same
 * outputs), so each 2-block tile holds both halves of 16 outputs and writes out [m, n / 2] = silu(gate) *
 * up straight from its accumulators: the GEMM's [m, n] output is never written nor read again by a
 * separate silu_and_mul pass. Each output sums over k in the same order as the plain kernel's. TILE: the
 * plain kernel's (XT activations, QTYPE weights); STORE: the epilogue (OT outputs); OUTP: the output policy
 * (OUT_BF16_ROWS, OUT_F32_ROWS). */
#define GATED_ROWS 6 /* rows of a two-pair tile: 4 blocks x 6 rows = 24 accumulators, as 3 x 8 */
#define GATED_GRAN 24 /* rows a shared tile is cut at (thread_share): a multiple of both tile heights */
#define DEFINE_GATED_WEIGHTS(NAME, TILE, XT, OT, QTYPE, STORE, OUTP)                                      \
    static int NAME(const XT *x, long x_stride, const uint8_t *w, const OT *bias, OT *out, long out_stride,  \
                    int m, int n, int k_int, int num_threads) {                                              \
        const int pairs = n / 32, inter = n / 2;                                                            \
        const long bstride = qgemm_step_bytes(k_int, QTYPE);                                                \
        _Pragma("omp parallel num_threads(num_threads) if ((long)m * n * k_int >= PAR_MIN && pairs > 1)")   \
        {                                                                                                   \
            /* tiles of two pairs, shared out like the plain kernel's tiles of blocks */                    \
            const Share s = thread_share(pairs, 2, m, GATED_GRAN, omp_get_thread_num(), omp_get_num_threads()); \
            __m512 acc[4 * MT]; /* block j's row r at j * MT + r */                                         \
            for (int p0 = s.b_begin; p0 < s.b_end; p0 += 2) {                                               \
                const int np = s.b_end - p0 < 2 ? 1 : 2; /* pairs in this tile */                           \
                const uint8_t *wb = w + 2L * p0 * bstride;                                                  \
                if (m > 2 && m <= MT) { /* one pair at a time over all rows: 6-row tiles would cut 8 rows  \
                                         * in two (at one or two rows the two-pair tile's four chains hide \
                                         * the latency) */                                                  \
                    for (int p = 0; p < np; p++) {                                                          \
                        const int rows = m, col = (p0 + p) * 16;                                            \
                        const uint8_t *wp = wb + 2L * p * bstride;                                          \
                        ROWS_SWITCH_ARGS(TILE, 2, x, wp, acc, ((Span){0, 0}))                               \
                        STORE(acc, acc + MT, rows, 0, col, out, out_stride, bias ? bias + col : NULL,       \
                              bias ? bias + inter + col : NULL);                                            \
                    }                                                                                       \
                    continue;                                                                               \
                }                                                                                           \
                const int left = s.b_end - p0 - np, np1 = left < 2 ? left : 2; /* the next tile's pairs */  \
                const uint8_t *next = np1 > 0 ? w + 2L * (p0 + np) * bstride : NULL;                       \
                const int r_begin = p0 == s.b_begin ? s.r_first : 0, r_end = left ? m : s.r_last;          \
                const int tile_rows = np == 2 ? GATED_ROWS : MT;                                            \
                const int row_tiles = (r_end - r_begin + tile_rows - 1) / tile_rows;                        \
                for (int r0 = r_begin; r0 < r_end; r0 += tile_rows) {                                       \
                    const int rows = r_end - r0 < tile_rows ? r_end - r0 : tile_rows;                       \
                    const XT *xr = x + (long)r0 * x_stride;                                                 \
                    const Span pf = next_share(next, 2L * np1 * bstride, (r0 - r_begin) / tile_rows, row_tiles); \
                    OUTP##_BEFORE(out, out_stride, (int)sizeof(OT), r0, rows, 16L * p0, 16L * np);         \
                    if (np == 2) {                                                                          \
                        switch (rows) {                                                                     \
                        case 1: TILE(1, 4, xr, wb, acc, pf); break;                                         \
                        case 2: TILE(2, 4, xr, wb, acc, pf); break;                                         \
                        case 3: TILE(3, 4, xr, wb, acc, pf); break;                                         \
                        case 4: TILE(4, 4, xr, wb, acc, pf); break;                                         \
                        case 5: TILE(5, 4, xr, wb, acc, pf); break;                                         \
                        default: TILE(6, 4, xr, wb, acc, pf); break;                                        \
                        }                                                                                   \
                    } else {                                                                                \
                        ROWS_SWITCH_ARGS(TILE, 2, xr, wb, acc, pf)                                          \
                    }                                                                                       \
                    for (int p = 0; p < np; p++) {                                                          \
                        const int col = (p0 + p) * 16;                                                      \
                        STORE(acc + 2 * p * MT, acc + (2 * p + 1) * MT, rows, r0, col, out, out_stride,     \
                              bias ? bias + col : NULL, bias ? bias + inter + col : NULL);                  \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
            OUTP##_DONE();                                                                                  \
        }                                                                                                   \
        return 0;                                                                                           \
    }
DEFINE_GATED_WEIGHTS(f32_weights_gated, F32_TILE, float, float, QT_F32, store_gated_f32, OUT_F32_ROWS)

#ifdef __AVX512BF16__
#define HAVE_DPBF16 1
/* bfloat16 activations: vdpbf16ps multiplies a pair of columns (k, k + 1) per lane. Codes (0..255)
 * and e4m3 values are exact in bfloat16, and so are the activations, so every product is exact; the
 * sums run per group over raw codes, and the group's zero and scale are applied once:
 * out += scale * (sum_k x * code - zero * sum_k x). The weights are never rounded. */
static const uint16_t BF16_OF_0_TO_15[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                              0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

static inline __m512i bf16_of_f32(__m512 v) { return _mm512_srli_epi32(_mm512_castps_si512(v), 16); }

/* columns one 64-byte step (4-bit, 8-bit codes) or one pair load (e4m3, bfloat16) covers */
static inline int step_cols(int qtype) { return qtype == QT_U4 ? 8 : qtype == QT_U8 ? 4 : 2; }

/* lane j: the bfloat16 pair (columns k0 + c, k0 + c + 1) of the block's row j, where `step` points at the
 * step holding column k0 and c (even, < step_cols) is a constant once inlined: the shifts are immediates */
static inline __attribute__((always_inline)) __m512i code_pairs(const uint8_t *step, int c, int qtype, __m512i lut) {
    if (qtype == QT_BF16) return _mm512_loadu_si512(step); /* already the pairs */
    if (qtype == QT_U4) { /* bytes c & 3 and (c & 3) + 1 of each row, one nibble of each */
        const __m512i v = _mm512_srli_epi32(_mm512_loadu_si512(step), 8 * (c & 3) + (c & 4));
        const __m512i idx = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(15)),
                                            _mm512_and_si512(_mm512_slli_epi32(v, 8), _mm512_set1_epi32(15 << 16)));
        return _mm512_permutexvar_epi16(idx, lut); /* 2 x 16 codes -> their bfloat16 values, one lookup */
    }
    __m512 lo, hi;
    if (qtype == QT_U8) {
        const __m512i v = _mm512_srli_epi32(_mm512_loadu_si512(step), 8 * c);
        lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(255)));
        hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8), _mm512_set1_epi32(255)));
    } else {
        lo = e4m3x16(step);
        hi = e4m3x16(step + 16);
    }
    return _mm512_or_si512(bf16_of_f32(lo), _mm512_slli_epi32(bf16_of_f32(hi), 16));
}

static inline __attribute__((always_inline)) void block_dp(int rows, const uint16_t *xb, const float *xsum,
                                                           int k_int, int gs, int qtype, const uint8_t *wb,
                                                           const float *sb, const float *zb, __m512 *out) {
    const __m512i lut = _mm512_loadu_si512(BF16_OF_0_TO_15);
    const int groups = k_int / gs;
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512 acc[MT];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int k0 = g * gs; k0 < (g + 1) * gs; k0 += step_cols(qtype)) {
            const uint8_t *step = wb + (long)k0 * column_bytes(qtype);
            _mm_prefetch((const char *)(step + PREFETCH_AHEAD), _MM_HINT_T0);
            for (int c = 0; c < step_cols(qtype); c += 2) {
                const __m512bh w = (__m512bh)code_pairs(step, c, qtype, lut);
                for (int r = 0; r < rows; r++) {
                    int32_t pair;
                    memcpy(&pair, xb + (long)r * k_int + k0 + c, 4);
                    acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_set1_epi32(pair));
                }
            }
        }
        const __m512 s = _mm512_loadu_ps(sb + g * 16);
        const __m512 z = zb ? _mm512_loadu_ps(zb + g * 16) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            out[r] = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[r * groups + g]), acc[r]), out[r]);
    }
}

/* Decode-sized M (<= SMALL_ROWS) on codes: NB blocks at once, as tile_bf16 does for bfloat16 weights: at
 * one row block_dp is a single chain of vdpbf16ps, bound by its latency. Per output the operations are
 * block_dp's, in its order, so a row's bits do not depend on which path its batch took. */
#define SMALL_ROWS 4
static inline __attribute__((always_inline)) void tile_dp(int rows, int nb, const uint16_t *xb, const float *xsum,
                                                          int k_int, int gs, int qtype, const uint8_t *wb,
                                                          long bstride, const float *sb, const float *zb,
                                                          long sstride, __m512 *out) {
    const __m512i lut = _mm512_loadu_si512(BF16_OF_0_TO_15);
    const int groups = k_int / gs;
    for (int i = 0; i < nb * SMALL_ROWS; i++) out[i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512 acc[NB_MAX * SMALL_ROWS];
        for (int i = 0; i < nb * SMALL_ROWS; i++) acc[i] = _mm512_setzero_ps();
        for (int k0 = g * gs; k0 < (g + 1) * gs; k0 += step_cols(qtype)) {
            const long off = (long)k0 * column_bytes(qtype), ahead = ahead_of(off, bstride, nb);
            for (int j = 0; j < nb; j++) _mm_prefetch((const char *)(wb + j * bstride + off + ahead), _MM_HINT_T0);
            for (int c = 0; c < step_cols(qtype); c += 2) {
                __m512bh w[NB_MAX];
                for (int j = 0; j < nb; j++) w[j] = (__m512bh)code_pairs(wb + j * bstride + off, c, qtype, lut);
                for (int r = 0; r < rows; r++) {
                    int32_t pair;
                    memcpy(&pair, xb + (long)r * k_int + k0 + c, 4);
                    const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                    for (int j = 0; j < nb; j++)
                        acc[j * SMALL_ROWS + r] = _mm512_dpbf16_ps(acc[j * SMALL_ROWS + r], w[j], x);
                }
            }
        }
        for (int j = 0; j < nb; j++) {
            const __m512 sc = _mm512_loadu_ps(sb + j * sstride + g * 16);
            const __m512 z = zb ? _mm512_loadu_ps(zb + j * sstride + g * 16) : _mm512_setzero_ps();
            for (int r = 0; r < rows; r++) {
                __m512 *o = out + j * SMALL_ROWS + r;
                *o = _mm512_fmadd_ps(sc, _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[r * groups + g]), acc[j * SMALL_ROWS + r]),
                                     *o);
            }
        }
    }
}

/* bfloat16 weights: NB blocks (NB * 16 output columns) at once against `rows` activation rows, so a
 * weight load feeds `rows` dot products and an activation broadcast NB of them (up to 24 accumulators in
 * registers), and NB independent chains hide vdpbf16ps's latency at one row. Per output the sum still
 * runs over k in one order, whatever the tile. */
static inline __attribute__((always_inline)) void tile_bf16(int rows, int nb, const uint16_t *xb, long x_stride,
                                                            int k_int, const uint8_t *wb, long bstride, __m512 *acc,
                                                            Span pf) {
    for (int i = 0; i < nb * MT; i++) acc[i] = _mm512_setzero_ps();
    const long pf_per = pf.lines > 0 ? (pf.lines + k_int / 2 - 1) / (k_int / 2) : 0; /* lines a k step */
    long pf_line = 0;
    for (int k = 0; k < k_int; k += 2) {
        for (long i = 0; i < pf_per && pf_line < pf.lines; i++, pf_line++)
            _mm_prefetch(pf.p + pf_line * 64, _MM_HINT_T1);
        __m512bh w[4]; /* nb <= 4: bf16_weights_gated's two pairs */
        const long off = (long)k * 32, ahead = ahead_of(off, bstride, nb);
        for (int j = 0; j < nb; j++) {
            const uint8_t *p = wb + j * bstride + off;
            w[j] = (__m512bh)_mm512_loadu_si512(p);
            _mm_prefetch((const char *)(p + ahead), _MM_HINT_T0);
        }
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, xb + (long)r * x_stride + k, 4);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < nb; j++) acc[j * MT + r] = _mm512_dpbf16_ps(acc[j * MT + r], w[j], x);
        }
    }
}
#endif
#endif

static void dequant_strip(const uint8_t *wb, int k_int, int gs, int qtype, const float *sb, const float *zb,
                          float *strip) {
    for (int k = 0; k < k_int; k++) {
        const int g = k / gs;
        dequant_step(wb, k, qtype, sb + g * 16, zb ? zb + g * 16 : ZERO16, strip + (long)k * 16);
    }
}

/* One output block (16 rows of W) for all m activation rows. */
static void run_block(int b, const float *xs, int m, int n, int k_int, int gs, int qtype, const uint8_t *w,
                      const float *scales, const float *zeros, const void *bias, void *out, long out_stride,
                      int out_bf16, float *strip) {
    const int groups = k_int / gs;
    const uint8_t *wb = w + b * qgemm_step_bytes(k_int, qtype);
    const float *sb = scales + (long)b * groups * 16;
    const float *zb = zeros ? zeros + (long)b * groups * 16 : 0;
#ifdef HAVE_AVX512
    __m512 acc[MT];
    if (m <= MT) {
        const int rows = m;
#define DIRECT(R) block_direct(R, xs, k_int, gs, qtype, wb, sb, zb, acc)
        ROWS_SWITCH(DIRECT)
#undef DIRECT
        store_tile(acc, rows, 0, b * 16, n, out, out_stride, out_bf16, bias);
        return;
    }
    dequant_strip(wb, k_int, gs, qtype, sb, zb, strip);
    for (int r0 = 0; r0 < m; r0 += MT) {
        const int rows = m - r0 < MT ? m - r0 : MT;
        const float *xr = xs + (long)r0 * k_int;
#define STRIP(R) block_strip(R, xr, k_int, strip, acc)
        ROWS_SWITCH(STRIP)
#undef STRIP
        store_tile(acc, rows, r0, b * 16, n, out, out_stride, out_bf16, bias);
    }
#else
    dequant_strip(wb, k_int, gs, qtype, sb, zb, strip);
    const int width = n - b * 16 < 16 ? n - b * 16 : 16;
    for (int r = 0; r < m; r++) {
        float acc[16] = {0};
        const float *xr = xs + (long)r * k_int;
        for (int k = 0; k < k_int; k++) {
            const float xv = xr[k], *wk = strip + (long)k * 16;
            for (int j = 0; j < 16; j++) acc[j] += xv * wk[j];
        }
        for (int j = 0; j < width; j++) store_value(out, out_stride, out_bf16, r, b * 16 + j, acc[j], bias);
    }
#endif
}

#ifdef HAVE_DPBF16
/* bfloat16 weights: tiles of NB_MAX blocks x MT rows (tile_bf16); x: bfloat16 rows x_stride apart, k_int
 * wide (gathered, or the caller's own when nothing is to be gathered). */
#define BF16_TILE(R, NB, X, WB, ACC, PF) tile_bf16(R, NB, X, x_stride, k_int, WB, bstride, ACC, PF)
DEFINE_PLAIN_WEIGHTS(bf16_weights, BF16_TILE, uint16_t, QT_BF16, 1, OUT_BF16_ROWS)

/* `rows` rows of a gate and an up accumulator block (+ their biases) -> 16 columns of T(silu(g)) * u, with
 * g and u the bfloat16 projections: cpu_ops.c's silu_and_mul on the rounded plain output, bit for bit. */
__attribute__((noinline)) static void store_gated(const __m512 *acc_g, const __m512 *acc_u, int rows, int r0, int col, uint16_t *out,
                        long out_stride, const uint16_t *bias_g, const uint16_t *bias_u) {
    const __m512 bg = bias_g ? load16_bf16(bias_g, 0xFFFF) : _mm512_setzero_ps();
    const __m512 bu = bias_u ? load16_bf16(bias_u, 0xFFFF) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 g = bf16_round(_mm512_add_ps(acc_g[r], bg));
        const __m512 u = bf16_round(_mm512_add_ps(acc_u[r], bu));
        const __m512 a = _mm512_div_ps(
            g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm256_storeu_si256((__m256i *)(out + (long)(r0 + r) * out_stride + col),
                            bf16_pack(_mm512_mul_ps(bf16_round(a), u)));
    }
}

DEFINE_GATED_WEIGHTS(bf16_weights_gated, BF16_TILE, uint16_t, uint16_t, QT_BF16, store_gated, OUT_BF16_ROWS)

/* bfloat16 activations: gathered (permuted, zero-padded) as bfloat16 with their per-group sums, then
 * MT-row tiles per block through block_dp. */
static int qgemm_bf16(const void *x, long x_stride, int k_in, const long *perm, const uint8_t *w,
                      const float *scales, const float *zeros, const void *bias, void *out, long out_stride, int m,
                      int n, int k_int, int gs, int qtype, int num_threads) {
    const int groups = k_int / gs, blocks = (n + 15) / 16;
    if (qtype == QT_BF16 && !perm && k_in == k_int) /* rows read in place: no gather, no group sums */
        return bf16_weights(x, x_stride, w, bias, out, out_stride, m, n, k_int, num_threads);
    uint16_t *xb = aligned_alloc(64, ((size_t)m * k_int * 2 + 63) / 64 * 64);
    float *xsum = aligned_alloc(64, ((size_t)m * groups * 4 + 63) / 64 * 64);
    if (!xb || !xsum) {
        free(xb);
        free(xsum);
        return -2;
    }
    const uint16_t *xin = (const uint16_t *)x;
    for (int r = 0; r < m; r++) {
        uint16_t *dst = xb + (long)r * k_int;
        for (int k = 0; k < k_int; k++) {
            const long src = perm ? perm[k] : (k < k_in ? k : -1);
            dst[k] = src < 0 ? 0 : xin[(long)r * x_stride + src];
        }
        for (int g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int k = g * gs; k < (g + 1) * gs; k++) sum += bf16_to_f32(dst[k]);
            xsum[r * groups + g] = sum;
        }
    }
    if (qtype == QT_BF16) { /* gathered (odd K padded): one group, scale one, no zeros */
        const int rc = bf16_weights(xb, k_int, w, bias, out, out_stride, m, n, k_int, num_threads);
        free(xb);
        free(xsum);
        return rc;
    }
    if (m <= SMALL_ROWS) {
        const long bstride = qgemm_step_bytes(k_int, qtype), sstride = (long)groups * 16;
        const int tiles = (blocks + NB_MAX - 1) / NB_MAX;
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((long)m * n * k_int >= PAR_MIN && tiles > 1)
        for (int t = 0; t < tiles; t++) {
            const Tile tl = tile_at(t, NB_MAX, blocks, w, bstride, scales, zeros, sstride);
            __m512 acc[NB_MAX * SMALL_ROWS];
#define TD_Q(R, NB, Q) tile_dp(R, NB, xb, xsum, k_int, gs, Q, tl.wb, bstride, tl.sb, tl.zb, sstride, acc)
#define TD(R, NB) QTYPE_SWITCH(TD_Q, R, NB)
#define TD_ROWS(NB)                                                                                        \
    switch (m) {                                                                                           \
    case 1: TD(1, NB); break;                                                                              \
    case 2: TD(2, NB); break;                                                                              \
    case 3: TD(3, NB); break;                                                                              \
    default: TD(4, NB); break;                                                                             \
    }
            if (tl.nb == 3) {
                TD_ROWS(3)
            } else if (tl.nb == 2) {
                TD_ROWS(2)
            } else {
                TD_ROWS(1)
            }
#undef TD_ROWS
#undef TD
            for (int j = 0; j < tl.nb; j++) store_tile(acc + j * SMALL_ROWS, m, 0, (tl.b0 + j) * 16, n, out, out_stride, 1, bias);
        }
        free(xb);
        free(xsum);
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((long)m * n * k_int >= PAR_MIN && blocks > 1)
    for (int b = 0; b < blocks; b++) {
        const uint8_t *wb = w + b * qgemm_step_bytes(k_int, qtype);
        const float *sb = scales + (long)b * groups * 16;
        const float *zb = zeros ? zeros + (long)b * groups * 16 : 0;
        __m512 acc[MT];
        for (int r0 = 0; r0 < m; r0 += MT) {
            const int rows = m - r0 < MT ? m - r0 : MT;
            const uint16_t *xr = xb + (long)r0 * k_int;
            const float *sr = xsum + (long)r0 * groups;
#define DP_Q(R, UNUSED, Q) block_dp(R, xr, sr, k_int, gs, Q, wb, sb, zb, acc)
#define DP(R) QTYPE_SWITCH(DP_Q, R, 0)
            ROWS_SWITCH(DP)
#undef DP
            store_tile(acc, rows, r0, b * 16, n, out, out_stride, 1, bias);
        }
    }
    free(xb);
    free(xsum);
    return 0;
}
#endif

#if defined(HAVE_AVX512) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#define I8_NB 3   /* blocks a tile covers at up to I8_SMALL rows (one row: three independent chains) */
#define I8_SMALL 2
#define I8_RT 4   /* rows a tile covers beyond that, two blocks wide: 24 accumulators in registers */

/* columns one activation scale covers: 32 where the group allows (Q8_0's block), else the largest
 * divisor of the group that is whole steps and at most 32 */
static int act_block(int gs, int unit) {
    if (gs % 32 == 0) return 32;
    for (int d = 32 - 32 % unit; d > unit; d -= unit)
        if (gs % d == 0) return d;
    return unit;
}

/* bfloat16 rows -> int8 codes xq [m][k_int] (gathered through perm, zero past k_in), a scale per row and
 * block xs [m][k_int / qb] (max|x| / 127) and per row and group xg [m][groups]: the sum of the quantized
 * activations times their scales, what a group's zero point multiplies. */
static void quantize_rows(const uint16_t *x, long x_stride, int k_in, const long *perm, int m, int k_int, int gs,
                          int qb, float *frow, int8_t *xq, float *xs, float *xg) {
    const int nqb = k_int / qb, groups = k_int / gs;
    for (int r = 0; r < m; r++) {
        const uint16_t *xr = x + (long)r * x_stride;
        if (perm) {
            for (int k = 0; k < k_int; k++) frow[k] = perm[k] < 0 ? 0.0f : bf16_to_f32(xr[perm[k]]);
        } else {
            for (int k = 0; k < k_int; k += 16) {
                const int valid = k_in - k;
                const __m512 v = valid > 0 ? load16_bf16(xr + k, mask_upto(valid)) : _mm512_setzero_ps();
                _mm512_mask_storeu_ps(frow + k, mask_upto(k_int - k), v);
            }
        }
        int8_t *qr = xq + (long)r * k_int;
        float *sr = xs + (long)r * nqb;
        float *gr = xg + (long)r * groups;
        for (int g = 0; g < groups; g++) gr[g] = 0.0f;
        for (int b = 0; b < nqb; b++) {
            const float *f = frow + (long)b * qb;
            __m512 amax = _mm512_setzero_ps();
            for (int i = 0; i < qb; i += 16)
                amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask_upto(qb - i), f + i)));
            const float top = _mm512_reduce_max_ps(amax);
            const float scale = top / 127.0f;
            const __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
            __m512i qsum = _mm512_setzero_si512();
            for (int i = 0; i < qb; i += 16) {
                const __mmask16 mk = mask_upto(qb - i);
                /* round to nearest even; |x| * inv <= 127 but for rounding, which the saturating pack clamps */
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, f + i), inv));
                _mm_mask_storeu_epi8(qr + (long)b * qb + i, mk, _mm512_cvtsepi32_epi8(q));
                qsum = _mm512_add_epi32(qsum, _mm512_maskz_mov_epi32(mk, _mm512_max_epi32(
                                                                       _mm512_min_epi32(q, _mm512_set1_epi32(127)),
                                                                       _mm512_set1_epi32(-127))));
            }
            sr[b] = scale;
            gr[(long)b * qb / gs] += scale * (float)_mm512_reduce_add_epi32(qsum);
        }
    }
}

/* `rows` quantized activation rows against nb blocks: per activation block, int32 sums of code x xq on
 * vpdpbusd (codes unsigned, activations signed), scaled into a float sum per group; per group
 * out += scale * (sum - zero * xg). Per output the operations and their order do not depend on the tile,
 * so a row's bits do not depend on its batch. */
static inline __attribute__((always_inline)) void tile_i8(int rows, int nb, int rstride, const int8_t *xq,
                                                          const float *xs, const float *xg, int k_int, int gs,
                                                          int qb, int qtype, const uint8_t *wb, long bstride,
                                                          const float *sb, const float *zb, long sstride,
                                                          __m512 *out) {
    const int groups = k_int / gs, nqb = k_int / qb, cols = qtype == QT_U4 ? 8 : 4;
    for (int i = 0; i < nb * rstride; i++) out[i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512 facc[I8_NB * I8_RT];
        for (int i = 0; i < nb * rstride; i++) facc[i] = _mm512_setzero_ps();
        for (int b = g * (gs / qb); b < (g + 1) * (gs / qb); b++) {
            __m512i acc[I8_NB * I8_RT];
            for (int i = 0; i < nb * rstride; i++) acc[i] = _mm512_setzero_si512();
            for (int k = b * qb; k < (b + 1) * qb; k += cols) {
                __m512i lo[I8_NB], hi[I8_NB];
                const long off = (long)(k >> (qtype == QT_U4 ? 3 : 2)) * 64, ahead = ahead_of(off, bstride, nb);
                for (int j = 0; j < nb; j++) {
                    const uint8_t *p = wb + j * bstride + off;
                    _mm_prefetch((const char *)(p + ahead), _MM_HINT_T0);
                    const __m512i v = _mm512_loadu_si512(p);
                    if (qtype == QT_U4) {
                        lo[j] = _mm512_and_si512(v, _mm512_set1_epi8(15));
                        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
                    } else {
                        lo[j] = v;
                    }
                }
                for (int r = 0; r < rows; r++) {
                    int32_t four;
                    memcpy(&four, xq + (long)r * k_int + k, 4);
                    const __m512i x = _mm512_set1_epi32(four);
                    for (int j = 0; j < nb; j++) acc[j * rstride + r] = _mm512_dpbusd_epi32(acc[j * rstride + r], lo[j], x);
                    if (qtype == QT_U4) {
                        memcpy(&four, xq + (long)r * k_int + k + 4, 4);
                        const __m512i xh = _mm512_set1_epi32(four);
                        for (int j = 0; j < nb; j++)
                            acc[j * rstride + r] = _mm512_dpbusd_epi32(acc[j * rstride + r], hi[j], xh);
                    }
                }
            }
            for (int r = 0; r < rows; r++) {
                const __m512 sx = _mm512_set1_ps(xs[(long)r * nqb + b]);
                for (int j = 0; j < nb; j++)
                    facc[j * rstride + r] = _mm512_fmadd_ps(sx, _mm512_cvtepi32_ps(acc[j * rstride + r]), facc[j * rstride + r]);
            }
        }
        for (int j = 0; j < nb; j++) {
            const __m512 s = _mm512_loadu_ps(sb + j * sstride + g * 16);
            const __m512 z = zb ? _mm512_loadu_ps(zb + j * sstride + g * 16) : _mm512_setzero_ps();
            for (int r = 0; r < rows; r++) {
                __m512 *o = out + j * rstride + r;
                *o = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(z, _mm512_set1_ps(xg[(long)r * groups + g]), facc[j * rstride + r]), *o);
            }
        }
    }
}

/* bfloat16 activations, 4-/8-bit codes: quantized activations on vpdpbusd (see the header). */
static int qgemm_i8(const void *x, long x_stride, int k_in, const long *perm, const uint8_t *w, const float *scales,
                    const float *zeros, const void *bias, void *out, long out_stride, int m, int n, int k_int, int gs,
                    int qtype, int num_threads) {
    const int qb = act_block(gs, qtype == QT_U4 ? 8 : 4), groups = k_int / gs, blocks = (n + 15) / 16;
    float *frow = aligned_alloc(64, ((size_t)k_int * 4 + 63) / 64 * 64);
    int8_t *xq = aligned_alloc(64, ((size_t)m * k_int + 63) / 64 * 64);
    float *xs = aligned_alloc(64, ((size_t)m * (k_int / qb) * 4 + 63) / 64 * 64);
    float *xg = aligned_alloc(64, ((size_t)m * groups * 4 + 63) / 64 * 64);
    if (!frow || !xq || !xs || !xg) {
        free(frow);
        free(xq);
        free(xs);
        free(xg);
        return -2;
    }
    quantize_rows((const uint16_t *)x, x_stride, k_in, perm, m, k_int, gs, qb, frow, xq, xs, xg);
    const long bstride = qgemm_step_bytes(k_int, qtype), sstride = (long)groups * 16;
    const int nb_max = m <= I8_SMALL ? I8_NB : 2, rt = m <= I8_SMALL ? I8_SMALL : I8_RT;
    const int tiles = (blocks + nb_max - 1) / nb_max;
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((long)m * n * k_int >= PAR_MIN && tiles > 1)
    for (int t = 0; t < tiles; t++) {
        const Tile tl = tile_at(t, nb_max, blocks, w, bstride, scales, zeros, sstride);
        __m512 acc[I8_NB * I8_RT];
        for (int r0 = 0; r0 < m; r0 += rt) {
            const int rows = m - r0 < rt ? m - r0 : rt;
            const int8_t *xr = xq + (long)r0 * k_int;
            const float *sr = xs + (long)r0 * (k_int / qb), *gr = xg + (long)r0 * groups;
#define TI(R, NB, RS)                                                                                      \
    do {                                                                                                   \
        if (qtype == QT_U4)                                                                                \
            tile_i8(R, NB, RS, xr, sr, gr, k_int, gs, qb, QT_U4, tl.wb, bstride, tl.sb, tl.zb, sstride, acc); \
        else                                                                                               \
            tile_i8(R, NB, RS, xr, sr, gr, k_int, gs, qb, QT_U8, tl.wb, bstride, tl.sb, tl.zb, sstride, acc); \
    } while (0)
            if (rt == I8_SMALL) {
                if (tl.nb == 3) {
                    if (rows == 1) TI(1, 3, I8_SMALL); else TI(2, 3, I8_SMALL);
                } else if (tl.nb == 2) {
                    if (rows == 1) TI(1, 2, I8_SMALL); else TI(2, 2, I8_SMALL);
                } else {
                    if (rows == 1) TI(1, 1, I8_SMALL); else TI(2, 1, I8_SMALL);
                }
            } else {
#define TI_ROWS(NB)                                                                                        \
    switch (rows) {                                                                                        \
    case 1: TI(1, NB, I8_RT); break;                                                                       \
    case 2: TI(2, NB, I8_RT); break;                                                                       \
    case 3: TI(3, NB, I8_RT); break;                                                                       \
    default: TI(4, NB, I8_RT); break;                                                                      \
    }
                if (tl.nb == 2) {
                    TI_ROWS(2)
                } else {
                    TI_ROWS(1)
                }
#undef TI_ROWS
            }
#undef TI
            for (int j = 0; j < tl.nb; j++) store_tile(acc + j * rt, rows, r0, (tl.b0 + j) * 16, n, out, out_stride, 1, bias);
        }
    }
    free(frow);
    free(xq);
    free(xs);
    free(xg);
    return 0;
}
#endif

/* 1 where bfloat16 activations run on vdpbf16ps (this build has AVX512-BF16): where bfloat16 weights
 * (QT_BF16) are worth this kernel rather than oneDNN (cpu/gemm.py asks). */
int qgemm_native_bf16(void) {
#ifdef HAVE_DPBF16
    return 1;
#else
    return 0;
#endif
}

/* 1 where float32 weights packed as QT_F32 run here (AVX-512): cpu/gemm.py then gives this kernel the
 * float32 linears instead of oneDNN. */
int qgemm_native_f32(void) {
#ifdef HAVE_AVX512
    return 1;
#else
    return 0;
#endif
}

/* 1 where bfloat16 activations can be quantized to int8 for 4-/8-bit codes (AVX512-VNNI). */
int qgemm_native_int8(void) {
#ifdef HAVE_VNNI
    return 1;
#else
    return 0;
#endif
}

/* out[m, n / 2] = silu(gate) * up of x[m, :] W^T + bias for a gated bfloat16 weight (bf16_weights_gated):
 * x, bias and out bfloat16, x k_int wide (no gathering). Returns 0, or -1 where this build has no
 * AVX512-BF16 or n is not a multiple of 32 (cpu/quant_gemm.py packs gated only where it runs). */
int qgemm_bf16_gated(const void *x, long x_stride, const uint8_t *w, const void *bias, void *out, long out_stride,
                     int m, int n, int k_int, int num_threads) {
#ifdef HAVE_DPBF16
    if (n % 32) return -1;
    if (m <= 0) return 0;
    return bf16_weights_gated((const uint16_t *)x, x_stride, w, (const uint16_t *)bias, (uint16_t *)out, out_stride,
                              m, n, k_int, num_threads);
#else
    (void)x; (void)x_stride; (void)w; (void)bias; (void)out; (void)out_stride; (void)m; (void)n; (void)k_int;
    (void)num_threads;
    return -1;
#endif
}

/* qgemm_bf16_gated's float32 counterpart, for a gated float32 weight (f32_weights_gated): x, bias and out
 * float32. Returns 0, or -1 where this build has no AVX-512 or n is not a multiple of 32. */
int qgemm_f32_gated(const void *x, long x_stride, const uint8_t *w, const void *bias, void *out, long out_stride,
                    int m, int n, int k_int, int num_threads) {
#ifdef HAVE_AVX512
    if (n % 32) return -1;
    if (m <= 0) return 0;
    return f32_weights_gated((const float *)x, x_stride, w, (const float *)bias, (float *)out, out_stride, m, n, k_int,
                             num_threads);
#else
    (void)x; (void)x_stride; (void)w; (void)bias; (void)out; (void)out_stride; (void)m; (void)n; (void)k_int;
    (void)num_threads;
    return -1;
#endif
}

/* out[m, n] = x[m, :] W^T + bias. x: float32 (x_bf16 = 0) or bfloat16 rows x_stride elements apart, k_in
 * wide; out and bias in the same dtype; act_int8: quantize bfloat16 activations for 4-/8-bit codes
 * where AVX512-VNNI allows (qgemm_i8). Returns 0, or -2 when scratch memory could not be allocated. */
int qgemm(const void *x, long x_stride, int x_bf16, int k_in, const long *perm, const uint8_t *w,
          const float *scales, const float *zeros, const void *bias, void *out, long out_stride, int m, int n,
          int k_int, int gs, int qtype, int act_int8, int num_threads) {
    if (m <= 0 || n <= 0) return 0;
    if (qtype == QT_F32) { /* float32 rows in place only (pack_f32's weights; cpu/quant_gemm.py checks) */
#ifdef HAVE_AVX512
        if (x_bf16 || perm || k_in != k_int) return -1;
        return f32_weights(x, x_stride, w, bias, out, out_stride, m, n, k_int, num_threads);
#else
        return -1;
#endif
    }
#ifdef HAVE_VNNI
    if (x_bf16 && act_int8 && (qtype == QT_U4 || qtype == QT_U8))
        return qgemm_i8(x, x_stride, k_in, perm, w, scales, zeros, bias, out, out_stride, m, n, k_int, gs, qtype,
                        num_threads);
#endif
#ifdef HAVE_DPBF16
    if (x_bf16) return qgemm_bf16(x, x_stride, k_in, perm, w, scales, zeros, bias, out, out_stride, m, n, k_int, gs,
                                  qtype, num_threads);
#endif
    const float *xs = (const float *)x;
    float *xbuf = 0;
    if (x_bf16 || perm || k_in != k_int || x_stride != k_int) {
        xbuf = aligned_alloc(64, ((size_t)m * k_int * 4 + 63) / 64 * 64);
        if (!xbuf) return -2;
        gather_x(x, x_stride, x_bf16, k_in, perm, xbuf, m, k_int);
        xs = xbuf;
    }
    const int blocks = (n + 15) / 16;
#ifdef HAVE_AVX512
    const int need_strip = m > MT;
#else
    const int need_strip = 1;
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if ((long)m * n * k_int >= PAR_MIN && blocks > 1)
    {
        float *strip = need_strip ? aligned_alloc(64, (size_t)k_int * 64) : 0;
        if (need_strip && !strip) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int b = 0; b < blocks; b++)
            if (!need_strip || strip)
                run_block(b, xs, m, n, k_int, gs, qtype, w, scales, zeros, bias, out, out_stride, x_bf16, strip);
        free(strip);
#ifdef HAVE_AVX512
        _mm_sfence(); /* store_tile's streamed float32 rows */
#endif
    }
    free(xbuf);
    return failed ? -2 : 0;
}
