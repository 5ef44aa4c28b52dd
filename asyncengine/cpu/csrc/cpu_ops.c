/* Fused element-wise ops for CPU workers: RMSNorm and LayerNorm (+ residual add), SiLU-and-mul, GPT-2's
 * GELU, rotary embedding, the greedy pick (argmax per row) and the paged KV-cache write.
 *
 * In torch each of these is 3-8 separate ops, each a pass over memory with an allocation and a
 * dispatch (in bfloat16 also a widen and a narrow per op); at decode sizes that overhead dominates.
 * Each function here is one pass per row. They reproduce torch's rounding chain in the narrow dtype
 * (every intermediate result torch would store as bf16 is rounded to bf16 here too), so a bf16 model
 * computes what the torch code computes up to float32 summation order. Rows are split across OpenMP
 * threads when there is enough work. Built by asyncengine/cpu/build.py.
 */
#include "cpu_common.h"

#define PAR_MIN 32768 /* elements below which waking threads costs more than it saves */

static inline float store_f32(float x) { return x; }
static inline float round_f32(float x) { return x; }
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* Both builds (AVX-512 below, portable C after #else) define the same three ops:
 * rms_norm: out = weight * T(x' * rsqrt(mean(x'^2) + eps)), x' = T(x + residual) (also stored in
 *   residual_out) or x when residual is NULL. Rows of x are x_stride elements apart; everything else
 *   is contiguous. heads > 1 (without a residual): each row of x holds `heads` rows of `hidden` side by
 *   side (Qwen3's q / k norm over each head), out row r being head r % heads of x's row r / heads.
 * rotary: the rotate-half (NeoX) embedding of `heads` heads per row: for the first 2 * half dims of a
 *   head, [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]; the rest is copied. x rows are x_stride
 *   elements apart; out is contiguous [rows, heads * head_dim]; cos, sin are [rows, half] in T.
 * silu_and_mul: out[r] = T(silu(gate)) * up for x[r] = [gate | up], each `inter` wide. */
/* rotary over rows: row r of x (x_stride elements apart) -> row r of out, contiguous. */
#define ROTARY_ROWS(SUF, T)                                                                             \
void rotary_##SUF(const T *x, long x_stride, const T *cos, const T *sin, T *out, int rows, int heads,  \
                  int head_dim, int half, int num_threads) {                                            \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if ((long)rows * heads * head_dim >= PAR_MIN)") \
    for (int r = 0; r < rows; r++)                                                                      \
        rotate_row_##SUF(x + (long)r * x_stride, cos + (long)r * half, sin + (long)r * half,            \
                         out + (long)r * heads * head_dim, heads, head_dim, half);                      \
}

#ifdef HAVE_AVX512
static inline __m512 ld16_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 ld16_bf16(const uint16_t *p, __mmask16 m) { return load16_bf16(p, m); }
static inline __m512 rnd16_f32(__m512 x) { return x; }
static inline __m512 rnd16_bf16(__m512 x) { return bf16_round(x); }
static inline void st16_f32(float *p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
static inline void st16_bf16(uint16_t *p, __m512 x, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, bf16_pack(x));
}

/* bfloat16 rows whose width is a multiple of 32, for RMSNorm: 32 elements a load, split in registers into
 * their even and odd elements as float32 (a shift, a mask), rounded to bfloat16 with integer ops (as
 * f32_to_bf16: nearest even, NaN quieted, denormals kept) and packed back with a shift and an or. The
 * 16-lane path widened with vpmovzxwd and rounded with vcvtneps2bf16 behind a vfpclassps check for
 * denormals, all shuffle-port or long-latency work: [256, 768] with a residual 56 -> 41 us on one thread,
 * [2048, 768] 469-506 -> 328-336 us, on two 232-336 -> 163-180 us (AMD Zen 5). Only the float32 sum of
 * squares runs in another order (lanes hold element pairs), so a last bit can differ from before. */
/* x rounded to bfloat16 (bf16_bits), kept as float32 bits (low half zero) */
static inline __m512i round_hi(__m512 x) { return _mm512_slli_epi32(bf16_bits(x), 16); }
/* even and odd float32 lanes rounded to bfloat16 and packed back into pairs */
static inline __m512i pack_pairs(__m512 even, __m512 odd) {
    return _mm512_or_si512(bf16_bits(even), _mm512_slli_epi32(bf16_bits(odd), 16));
}
static void rms_row_pairs(const uint16_t *xr, const uint16_t *rr, const uint16_t *weight, uint16_t *o,
                          uint16_t *ro, int hidden, float eps) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (int d = 0; d < hidden; d += 32) {
        const __m512i xv = _mm512_loadu_si512(xr + d);
        __m512 e = bf16_even_f32(xv), od = bf16_odd_f32(xv);
        if (rr) {
            const __m512i rv = _mm512_loadu_si512(rr + d);
            const __m512i eh = round_hi(_mm512_add_ps(e, bf16_even_f32(rv)));
            const __m512i oh = round_hi(_mm512_add_ps(od, bf16_odd_f32(rv)));
            _mm512_storeu_si512(ro + d, _mm512_or_si512(_mm512_srli_epi32(eh, 16), oh));
            e = _mm512_castsi512_ps(eh);
            od = _mm512_castsi512_ps(oh);
        }
        s0 = _mm512_add_ps(s0, _mm512_mul_ps(e, e));
        s1 = _mm512_add_ps(s1, _mm512_mul_ps(od, od));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) / (float)hidden + eps));
    const uint16_t *src = rr ? ro : xr;
    for (int d = 0; d < hidden; d += 32) {
        const __m512i v = _mm512_loadu_si512(src + d), w = _mm512_loadu_si512(weight + d);
        const __m512 ne = _mm512_castsi512_ps(round_hi(_mm512_mul_ps(bf16_even_f32(v), inv)));
        const __m512 no = _mm512_castsi512_ps(round_hi(_mm512_mul_ps(bf16_odd_f32(v), inv)));
        _mm512_storeu_si512(o + d, pack_pairs(_mm512_mul_ps(bf16_even_f32(w), ne), _mm512_mul_ps(bf16_odd_f32(w), no)));
    }
}

/* 16 lanes at a time: gcc does not vectorise the scalar bfloat16 rounding (its NaN branch), and the
 * scalar loop took ~1 ns an element (50 us for a [64, 768] decode step's norm, 25 of them a step). */
#define DEFINE_OPS(SUF, T, LOAD, STORE, ROUND)                                                          \
void rms_norm_##SUF(const T *x, long x_stride, int heads, const T *residual, const T *weight, T *out,    \
                    T *residual_out, int rows, int hidden, float eps, int num_threads) {                 \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if ((long)rows * hidden >= PAR_MIN)") \
    for (int r = 0; r < rows; r++) {                                                                    \
        const T *xr = x + (long)(r / heads) * x_stride + (long)(r % heads) * hidden;                    \
        const T *rr = residual ? residual + (long)r * hidden : 0;                                       \
        T *ro = residual_out ? residual_out + (long)r * hidden : 0;                                     \
        T *o = out + (long)r * hidden;                                                                  \
        if (sizeof(T) == 2 && hidden % 32 == 0) { /* bfloat16 */                                        \
            rms_row_pairs((const uint16_t *)xr, (const uint16_t *)rr, (const uint16_t *)weight, (uint16_t *)o, \
                          (uint16_t *)ro, hidden, eps);                                                 \
            continue;                                                                                   \
        }                                                                                               \
        __m512 ss = _mm512_setzero_ps();                                                                \
        for (int d = 0; d < hidden; d += 16) {                                                          \
            const __mmask16 mk = mask_upto(hidden - d);                                                 \
            __m512 v = ld16_##SUF(xr + d, mk);                                                          \
            if (rr) {                                                                                   \
                v = rnd16_##SUF(_mm512_add_ps(v, ld16_##SUF(rr + d, mk)));                              \
                st16_##SUF(ro + d, v, mk);                                                              \
            }                                                                                           \
            ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));                                                \
        }                                                                                               \
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)hidden + eps)); \
        const T *src = rr ? ro : xr;                                                                    \
        for (int d = 0; d < hidden; d += 16) {                                                          \
            const __mmask16 mk = mask_upto(hidden - d);                                                 \
            const __m512 n = rnd16_##SUF(_mm512_mul_ps(ld16_##SUF(src + d, mk), inv));                  \
            st16_##SUF(o + d, _mm512_mul_ps(ld16_##SUF(weight + d, mk), n), mk);                        \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
static inline void rotate_row_##SUF(const T *x, const T *c, const T *s, T *out, int heads, int head_dim, \
                                    int half) {                                                         \
    for (int h = 0; h < heads; h++) {                                                                   \
        const T *xh = x + (long)h * head_dim;                                                           \
        T *oh = out + (long)h * head_dim;                                                               \
        for (int d = 0; d < half; d += 16) {                                                            \
            const __mmask16 mk = mask_upto(half - d);                                                   \
            const __m512 x1 = ld16_##SUF(xh + d, mk), x2 = ld16_##SUF(xh + half + d, mk);               \
            const __m512 cd = ld16_##SUF(c + d, mk), sd = ld16_##SUF(s + d, mk);                        \
            st16_##SUF(oh + d, _mm512_sub_ps(rnd16_##SUF(_mm512_mul_ps(x1, cd)),                        \
                                             rnd16_##SUF(_mm512_mul_ps(x2, sd))), mk);                  \
            st16_##SUF(oh + half + d, _mm512_add_ps(rnd16_##SUF(_mm512_mul_ps(x2, cd)),                 \
                                                    rnd16_##SUF(_mm512_mul_ps(x1, sd))), mk);           \
        }                                                                                               \
        for (int d = 2 * half; d < head_dim; d++) oh[d] = xh[d];                                        \
    }                                                                                                   \
}                                                                                                       \
ROTARY_ROWS(SUF, T)

#define DEFINE_SILU(SUF, T, LOAD, STORE, ROUND)                                                         \
void silu_and_mul_##SUF(const T *x, T *out, int rows, int inter, int num_threads) {                     \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if ((long)rows * inter >= 4 * PAR_MIN)") \
    for (int r = 0; r < rows; r++) {                                                                    \
        const T *g = x + (long)r * 2 * inter, *u = g + inter;                                           \
        T *o = out + (long)r * inter;                                                                   \
        for (int d = 0; d < inter; d += 16) {                                                           \
            const __mmask16 mk = mask_upto(inter - d);                                                  \
            const __m512 gv = ld16_##SUF(g + d, mk);                                                    \
            const __m512 a = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f),                     \
                                                             exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv)))); \
            st16_##SUF(o + d, _mm512_mul_ps(rnd16_##SUF(a), ld16_##SUF(u + d, mk)), mk);                \
        }                                                                                               \
    }                                                                                                   \
}
#else
#define DEFINE_OPS(SUF, T, LOAD, STORE, ROUND)                                                          \
void rms_norm_##SUF(const T *x, long x_stride, int heads, const T *residual, const T *weight, T *out,    \
                    T *residual_out, int rows, int hidden, float eps, int num_threads) {                 \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if ((long)rows * hidden >= PAR_MIN)") \
    for (int r = 0; r < rows; r++) {                                                                    \
        const T *xr = x + (long)(r / heads) * x_stride + (long)(r % heads) * hidden;                                                           \
        const T *rr = residual ? residual + (long)r * hidden : 0;                                       \
        T *ro = residual_out ? residual_out + (long)r * hidden : 0;                                     \
        T *o = out + (long)r * hidden;                                                                  \
        float ss = 0.f;                                                                                 \
        if (rr) {                                                                                       \
            _Pragma("omp simd reduction(+:ss)")                                                         \
            for (int d = 0; d < hidden; d++) {                                                          \
                const float s = ROUND(LOAD(xr[d]) + LOAD(rr[d]));                                       \
                ro[d] = STORE(s);                                                                       \
                ss += s * s;                                                                            \
            }                                                                                           \
        } else {                                                                                        \
            _Pragma("omp simd reduction(+:ss)")                                                         \
            for (int d = 0; d < hidden; d++) { const float s = LOAD(xr[d]); ss += s * s; }              \
        }                                                                                               \
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);                                       \
        const T *src = rr ? ro : xr;                                                                    \
        _Pragma("omp simd")                                                                             \
        for (int d = 0; d < hidden; d++) o[d] = STORE(LOAD(weight[d]) * ROUND(LOAD(src[d]) * inv));     \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
static inline void rotate_row_##SUF(const T *x, const T *c, const T *s, T *out, int heads, int head_dim, \
                                    int half) {                                                         \
    for (int h = 0; h < heads; h++) {                                                                   \
        const T *xh = x + (long)h * head_dim;                                                           \
        T *oh = out + (long)h * head_dim;                                                               \
        _Pragma("omp simd")                                                                             \
        for (int d = 0; d < half; d++) {                                                                \
            const float x1 = LOAD(xh[d]), x2 = LOAD(xh[half + d]), cd = LOAD(c[d]), sd = LOAD(s[d]);    \
            oh[d] = STORE(ROUND(x1 * cd) - ROUND(x2 * sd));                                             \
            oh[half + d] = STORE(ROUND(x2 * cd) + ROUND(x1 * sd));                                      \
        }                                                                                               \
        for (int d = 2 * half; d < head_dim; d++) oh[d] = xh[d];                                        \
    }                                                                                                   \
}                                                                                                       \
ROTARY_ROWS(SUF, T)

#define DEFINE_SILU(SUF, T, LOAD, STORE, ROUND)                                                         \
void silu_and_mul_##SUF(const T *x, T *out, int rows, int inter, int num_threads) {                     \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if ((long)rows * inter >= PAR_MIN)") \
    for (int r = 0; r < rows; r++) {                                                                    \
        const T *g = x + (long)r * 2 * inter, *u = g + inter;                                           \
        T *o = out + (long)r * inter;                                                                   \
        for (int d = 0; d < inter; d++) {                                                               \
            const float gv = LOAD(g[d]);                                                                \
            o[d] = STORE(ROUND(gv / (1.0f + expf(-gv))) * LOAD(u[d]));                                  \
        }                                                                                               \
    }                                                                                                   \
}
#endif

DEFINE_OPS(f32, float, load_f32, store_f32, round_f32)
DEFINE_OPS(bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
DEFINE_SILU(f32, float, load_f32, store_f32, round_f32)
DEFINE_SILU(bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)

/* gelu_new: HF's NewGELUActivation (GPT-2's activation), 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))),
 *   with torch's rounding chain: each of its 8 ops' results rounded to T (pow(x, 3) is (x * x) * x with the
 *   square rounded to T too, the scalars float32). bfloat16 results are torch's bit for bit; in float32
 *   tanh (Cephes' tanhf here, torch's is Sleef's) can move a last bit. In torch it is 8 passes over the
 *   MLP's [tokens, 4 hidden] activations: a fifth of a GPT-2 prefill (bench/RESULTS.md, 2026-12-07).
 * layer_norm: out = T((x' - mean) rstd w + b) with mean and rstd in float32 (two passes over the row),
 *   x' = T(x + residual) (also stored in residual_out) or x when residual is NULL, as rms_norm; rows of x
 *   x_stride elements apart, bias may be NULL. */
#define GELU_A 0.044715f
#define GELU_C 0.7978845608028654f /* sqrt(2 / pi) as float32, as torch takes the Python scalar */
#ifdef HAVE_AVX512
/* tanh as Cephes' tanhf: an odd polynomial up to |x| = 0.625, 1 - 2 / (e^(2|x|) + 1) beyond */
static inline __m512 tanh512(__m512 x) {
    const __m512 ax = _mm512_abs_ps(x), s = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
    p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(2.06390887954e-2f));
    p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(-5.37397155531e-2f));
    p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(1.33314422036e-1f));
    p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(-3.33332819422e-1f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, s), x, x);
    const __m512 e = exp512(_mm512_add_ps(ax, ax));
    const __m512 big = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                                     _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    const __m512 signed_big = _mm512_or_ps(big, _mm512_and_ps(x, _mm512_set1_ps(-0.0f)));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_GT_OQ), small, signed_big);
}

/* gelu_new on 16 float32 lanes, RND rounding each op's result as T would hold it */
#define GELU16(v, RND)                                                                                  \
    ({                                                                                                  \
        const __m512 p_ = RND(_mm512_mul_ps(RND(_mm512_mul_ps(v, v)), v));                              \
        const __m512 b_ = RND(_mm512_add_ps(v, RND(_mm512_mul_ps(p_, _mm512_set1_ps(GELU_A)))));       \
        const __m512 t_ = RND(tanh512(RND(_mm512_mul_ps(b_, _mm512_set1_ps(GELU_C)))));                 \
        const __m512 u_ = RND(_mm512_add_ps(t_, _mm512_set1_ps(1.0f)));                                 \
        _mm512_mul_ps(RND(_mm512_mul_ps(v, _mm512_set1_ps(0.5f))), u_);                                 \
    })
/* x rounded to bfloat16 as float32 with integer ops only (bf16_bits: nearest even, NaN quieted,
 * denormals kept): 8 roundings a vector through vcvtneps2bf16 and widening shuffles had made the bfloat16
 * GELU 1.4x slower than the float32 one */
static inline __m512 rnd_pairs(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)); }
static inline __m512 rnd_none(__m512 x) { return x; }

#define DEFINE_GELU_LN(SUF, T)                                                                          \
void gelu_new_##SUF(const T *x, T *out, long n, int num_threads) {                                      \
    const long chunks = (n + 31) / 32;                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (n >= PAR_MIN)")             \
    for (long c = 0; c < chunks; c++) {                                                                 \
        const long i = c * 32;                                                                          \
        if (sizeof(T) == 2 && n - i >= 32) { /* bfloat16: 32 values as even and odd float32 lanes */   \
            const __m512i xv = _mm512_loadu_si512((const uint16_t *)x + i);                             \
            const __m512 e = bf16_even_f32(xv), o = bf16_odd_f32(xv);                                   \
            const __m512 ge = GELU16(e, rnd_pairs), go = GELU16(o, rnd_pairs);                          \
            _mm512_storeu_si512((uint16_t *)out + i, pack_pairs(ge, go));                               \
            continue;                                                                                   \
        }                                                                                               \
        for (long j = i; j < i + 32 && j < n; j += 16) {                                                \
            const __mmask16 mk = mask_upto(n - j < 16 ? (int)(n - j) : 16);                             \
            const __m512 v = ld16_##SUF(x + j, mk);                                                     \
            st16_##SUF(out + j, GELU16(v, rnd16_##SUF), mk);                                            \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
void layer_norm_##SUF(const T *x, long x_stride, const T *residual, const T *weight, const T *bias,     \
                      T *out, T *residual_out, int rows, int hidden, float eps, int num_threads) {      \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if ((long)rows * hidden >= PAR_MIN)") \
    for (int r = 0; r < rows; r++) {                                                                    \
        const T *xr = x + (long)r * x_stride;                                                           \
        const T *rr = residual ? residual + (long)r * hidden : 0;                                       \
        T *ro = residual_out ? residual_out + (long)r * hidden : 0;                                     \
        T *o = out + (long)r * hidden;                                                                  \
        __m512 sum = _mm512_setzero_ps();                                                               \
        for (int d = 0; d < hidden; d += 16) {                                                          \
            const __mmask16 mk = mask_upto(hidden - d);                                                 \
            __m512 v = ld16_##SUF(xr + d, mk);                                                          \
            if (rr) {                                                                                   \
                v = rnd16_##SUF(_mm512_add_ps(v, ld16_##SUF(rr + d, mk)));                              \
                st16_##SUF(ro + d, v, mk);                                                              \
            }                                                                                           \
            sum = _mm512_add_ps(sum, v);                                                                \
        }                                                                                               \
        const float mean = _mm512_reduce_add_ps(sum) / (float)hidden;                                   \
        const T *src = rr ? ro : xr;                                                                    \
        __m512 sq = _mm512_setzero_ps();                                                                \
        for (int d = 0; d < hidden; d += 16) {                                                          \
            const __mmask16 mk = mask_upto(hidden - d);                                                 \
            const __m512 diff = _mm512_maskz_sub_ps(mk, ld16_##SUF(src + d, mk), _mm512_set1_ps(mean)); \
            sq = _mm512_add_ps(sq, _mm512_mul_ps(diff, diff));                                          \
        }                                                                                               \
        const float rstd = 1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)hidden + eps);                \
        const __m512 scale = _mm512_set1_ps(rstd), shift = _mm512_set1_ps(-mean * rstd);                \
        for (int d = 0; d < hidden; d += 16) {                                                          \
            const __mmask16 mk = mask_upto(hidden - d);                                                 \
            const __m512 n = _mm512_add_ps(_mm512_mul_ps(ld16_##SUF(src + d, mk), scale), shift);       \
            const __m512 y = _mm512_mul_ps(n, ld16_##SUF(weight + d, mk));                              \
            st16_##SUF(o + d, bias ? _mm512_add_ps(y, ld16_##SUF(bias + d, mk)) : y, mk);               \
        }                                                                                               \
    }                                                                                                   \
}
#else
#define DEFINE_GELU_LN(SUF, T, LOAD, STORE, ROUND)                                                      \
void gelu_new_##SUF(const T *x, T *out, long n, int num_threads) {                                      \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (n >= PAR_MIN)")             \
    for (long i = 0; i < n; i++) {                                                                      \
        const float v = LOAD(x[i]);                                                                     \
        const float b = ROUND(v + ROUND(ROUND(ROUND(v * v) * v) * GELU_A));                             \
        const float u = ROUND(ROUND(tanhf(ROUND(b * GELU_C))) + 1.0f);                                  \
        out[i] = STORE(ROUND(v * 0.5f) * u);                                                            \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
void layer_norm_##SUF(const T *x, long x_stride, const T *residual, const T *weight, const T *bias,     \
                      T *out, T *residual_out, int rows, int hidden, float eps, int num_threads) {      \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if ((long)rows * hidden >= PAR_MIN)") \
    for (int r = 0; r < rows; r++) {                                                                    \
        const T *xr = x + (long)r * x_stride;                                                           \
        const T *rr = residual ? residual + (long)r * hidden : 0;                                       \
        T *ro = residual_out ? residual_out + (long)r * hidden : 0;                                     \
        T *o = out + (long)r * hidden;                                                                  \
        float sum = 0.f, sq = 0.f;                                                                      \
        for (int d = 0; d < hidden; d++) {                                                              \
            float v = LOAD(xr[d]);                                                                      \
            if (rr) {                                                                                   \
                v = ROUND(v + LOAD(rr[d]));                                                             \
                ro[d] = STORE(v);                                                                       \
            }                                                                                           \
            sum += v;                                                                                   \
        }                                                                                               \
        const float mean = sum / (float)hidden;                                                         \
        const T *src = rr ? ro : xr;                                                                    \
        for (int d = 0; d < hidden; d++) { const float diff = LOAD(src[d]) - mean; sq += diff * diff; }  \
        const float rstd = 1.0f / sqrtf(sq / (float)hidden + eps), shift = -mean * rstd;                \
        for (int d = 0; d < hidden; d++) {                                                              \
            const float y = (LOAD(src[d]) * rstd + shift) * LOAD(weight[d]);                            \
            o[d] = STORE(bias ? y + LOAD(bias[d]) : y);                                                 \
        }                                                                                               \
    }                                                                                                   \
}
#endif
#ifdef HAVE_AVX512
DEFINE_GELU_LN(f32, float)
DEFINE_GELU_LN(bf16, uint16_t)
#else
DEFINE_GELU_LN(f32, float, load_f32, store_f32, round_f32)
DEFINE_GELU_LN(bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
#endif

/* out[r] = the first index of row r's maximum, or of its first NaN: what torch's max(dim).indices
 * returns. Reads bf16 logits as they are (no float32 copy of [rows, vocab] first). */
#ifdef HAVE_AVX512
/* Each lane keeps its first maximum (strict >) and where it was; the answer is the smallest position
 * among the lanes that hold the row's maximum. */
#define DEFINE_ARGMAX(SUF, T, LOAD, LOAD16)                                                             \
void argmax_rows_##SUF(const T *x, long x_stride, int rows, int cols, int64_t *out, int num_threads) {  \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if ((long)rows * cols >= PAR_MIN)") \
    for (int r = 0; r < rows; r++) {                                                                    \
        const T *xr = x + (long)r * x_stride;                                                           \
        __m512 best = _mm512_set1_ps(-INFINITY);                                                        \
        __m512i where = _mm512_setzero_si512(), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); \
        __mmask16 nan = 0;                                                                              \
        for (int c = 0; c < cols; c += 16) {                                                            \
            const __mmask16 mk = mask_upto(cols - c);                                                   \
            const __m512 v = LOAD16(xr + c, mk);                                                        \
            nan |= _mm512_mask_cmp_ps_mask(mk, v, v, _CMP_UNORD_Q);                                     \
            const __mmask16 gt = _mm512_mask_cmp_ps_mask(mk, v, best, _CMP_GT_OQ);                      \
            best = _mm512_mask_mov_ps(best, gt, v);                                                     \
            where = _mm512_mask_mov_epi32(where, gt, at);                                               \
            at = _mm512_add_epi32(at, _mm512_set1_epi32(16));                                           \
        }                                                                                               \
        if (nan) {                                                                                      \
            int c = 0;                                                                                  \
            while (LOAD(xr[c]) == LOAD(xr[c])) c++;                                                     \
            out[r] = c;                                                                                 \
        } else { /* a row of -inf only: every lane still says 0, the right answer */                    \
            const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ); \
            out[r] = _mm512_reduce_min_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(0x7fffffff), top, where)); \
        }                                                                                               \
    }                                                                                                   \
}
DEFINE_ARGMAX(f32, float, load_f32, load16_f32)
DEFINE_ARGMAX(bf16, uint16_t, bf16_to_f32, load16_bf16)
#else
#define DEFINE_ARGMAX(SUF, T, LOAD)                                                                     \
void argmax_rows_##SUF(const T *x, long x_stride, int rows, int cols, int64_t *out, int num_threads) {  \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if ((long)rows * cols >= PAR_MIN)") \
    for (int r = 0; r < rows; r++) {                                                                    \
        const T *xr = x + (long)r * x_stride;                                                           \
        float m = -INFINITY;                                                                            \
        int64_t best = 0;                                                                               \
        for (int c = 0; c < cols; c++) {                                                                \
            const float v = LOAD(xr[c]);                                                                \
            if (v != v) { best = c; break; }                                                            \
            if (v > m) { m = v; best = c; }                                                             \
        }                                                                                               \
        out[r] = best;                                                                                  \
    }                                                                                                   \
}
DEFINE_ARGMAX(f32, float, load_f32)
DEFINE_ARGMAX(bf16, uint16_t, bf16_to_f32)
#endif

/* The paged KV-cache write of a step: row r of k (and of v) -> cache slot slots[r]. Rows are
 * row_bytes long (kv_heads * head_dim elements) and k_stride / v_stride bytes apart: k and v are
 * column slices of the fused qkv projection. A slot outside [0, num_slots) is skipped and counted, so
 * the caller can raise instead of writing out of bounds. torch's index_copy_ took ~57 us per call
 * here, 24 calls per decode step of a 12-layer model.
 * A decode step writes one row per sequence into lines no cache holds, so a plain store first reads
 * each line from memory (read-for-ownership), one scattered slot after another: ~55 us for 64 rows of
 * 1.5 KiB. Non-temporal stores skip that read (~30 us). Large writes (prefill chunks, whose attention
 * reads them back right away) keep the cached memcpy. */
#define NT_MAX_BYTES (1L << 20)

static void copy_row(char *dst, const char *src, int row_bytes, int stream) {
#ifdef HAVE_AVX512
    if (stream) {
        for (int o = 0; o < row_bytes; o += 64)
            _mm512_stream_si512((__m512i *)(dst + o), _mm512_loadu_si512(src + o));
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, (size_t)row_bytes);
}

/* Non-temporal stores for a write of `rows` rows of row_bytes when the lines allow it and it is small
 * enough not to be read back at once (see above). */
static int use_stream(const void *k_cache, const void *v_cache, int rows, int row_bytes) {
    return row_bytes % 64 == 0 && (uintptr_t)k_cache % 64 == 0 && (uintptr_t)v_cache % 64 == 0
           && (long)rows * row_bytes <= NT_MAX_BYTES;
}

/* One token's k and v rows -> cache slot `slot`; returns 1 (nothing written) for a slot outside the cache. */
static int write_slot(char *k_cache, char *v_cache, int64_t slot, long num_slots, const char *k_row,
                      const char *v_row, int row_bytes, int stream) {
    if (slot < 0 || slot >= num_slots) return 1;
    copy_row(k_cache + slot * row_bytes, k_row, row_bytes, stream);
    copy_row(v_cache + slot * row_bytes, v_row, row_bytes, stream);
    return 0;
}

/* The streamed lines are visible before anyone reads the cache. */
static void end_stream(int stream) {
#ifdef HAVE_AVX512
    if (stream) _mm_sfence();
#endif
    (void)stream;
}

long write_kv(const char *k, long k_stride, const char *v, long v_stride, char *k_cache, char *v_cache,
              const int64_t *slots, long num_slots, int rows, int row_bytes) {
    long bad = 0;
    const int stream = use_stream(k_cache, v_cache, rows, row_bytes);
    for (int r = 0; r < rows; r++)
        bad += write_slot(k_cache, v_cache, slots[r], num_slots, k + (long)r * k_stride,
                          v + (long)r * v_stride, row_bytes, stream);
    end_stream(stream);
    return bad;
}

/* Rows ahead that rope_write_kv prefetches. Its q / k / v rows (the qkv projection's output: 4.5 KiB a row
 * at hidden 768) are often out of cache by the time it runs, and the hardware prefetcher does not follow
 * its masked half-line bfloat16 loads: [2048 rows, 12 x 64] with the qkv input out of cache took 1.46 ms a
 * call, 0.56-0.64 with the next rows prefetched 4 ahead (0.41 ms with the input in cache; AMD Zen 5, 2
 * threads; 1, 2 and 8 ahead within noise of 4). float32 (full-line loads, which it follows) measured level
 * with and without; prefetching the cache slots for writing as well measured level. */
#define ROPE_AHEAD 4
/* The rotary embedding of a step's q and k and its KV-cache write in one pass over the rows (one call per
 * layer instead of three): q -> q_out, k -> k_out and its slot of k_cache, v -> its slot of v_cache. q, k,
 * v are column slices of the fused qkv projection (row strides in elements); q_out, k_out contiguous.
 * Each row's rotated k is copied to the cache while it is still in L1. Slots outside [0, num_slots) are
 * skipped and counted, as in write_kv. */
#define DEFINE_ROPE_WRITE_KV(SUF, T)                                                                    \
long rope_write_kv_##SUF(const T *q, long q_stride, const T *k, long k_stride, const T *v, long v_stride, \
                         const T *cos, const T *sin, T *q_out, T *k_out, T *k_cache, T *v_cache,        \
                         const int64_t *slots, long num_slots, int rows, int heads, int kv_heads,       \
                         int head_dim, int half, int num_threads) {                                     \
    const int row_bytes = kv_heads * head_dim * (int)sizeof(T);                                         \
    const int stream = use_stream(k_cache, v_cache, rows, row_bytes);                                   \
    long bad = 0;                                                                                       \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) reduction(+:bad) if ((long)rows * (heads + 2 * kv_heads) * head_dim >= PAR_MIN)") \
    for (int r = 0; r < rows; r++) {                                                                    \
        if (r + ROPE_AHEAD < rows) {                                                                    \
            prefetch_bytes(q + (long)(r + ROPE_AHEAD) * q_stride, heads * head_dim * (int)sizeof(T));  \
            prefetch_bytes(k + (long)(r + ROPE_AHEAD) * k_stride, row_bytes);                          \
            prefetch_bytes(v + (long)(r + ROPE_AHEAD) * v_stride, row_bytes);                          \
        }                                                                                               \
        const T *c = cos + (long)r * half, *s = sin + (long)r * half;                                   \
        T *ko = k_out + (long)r * kv_heads * head_dim;                                                  \
        rotate_row_##SUF(q + (long)r * q_stride, c, s, q_out + (long)r * heads * head_dim, heads, head_dim, half); \
        rotate_row_##SUF(k + (long)r * k_stride, c, s, ko, kv_heads, head_dim, half);                   \
        bad += write_slot((char *)k_cache, (char *)v_cache, slots[r], num_slots, (const char *)ko,       \
                          (const char *)(v + (long)r * v_stride), row_bytes, stream);                   \
    }                                                                                                   \
    end_stream(stream);                                                                                 \
    return bad;                                                                                         \
}
DEFINE_ROPE_WRITE_KV(f32, float)
DEFINE_ROPE_WRITE_KV(bf16, uint16_t)

/* out[i] = table[idx[i]] for n ids, converted from the table's dtype to out's (float32 or bfloat16,
 * rounded to nearest even): the embedding lookup and the step's rotary cos / sin rows, as a kernel call
 * (a kernel graph replays it from C; as torch ops it was an index and a conversion a table). Ids outside
 * [0, table_rows) get a zero row and are counted. */
long gather_rows(const void *table, int src_bf16, long table_rows, long width, const int64_t *idx, long n,
                 void *out, int dst_bf16) {
    long bad = 0;
    const size_t src_size = src_bf16 ? 2 : 4, dst_size = dst_bf16 ? 2 : 4;
    for (long i = 0; i < n; i++) {
        char *dst = (char *)out + (size_t)i * width * dst_size;
        const long row = idx[i];
        if (row < 0 || row >= table_rows) {
            memset(dst, 0, (size_t)width * dst_size);
            bad++;
            continue;
        }
        const char *src = (const char *)table + (size_t)row * width * src_size;
        if (src_bf16 == dst_bf16) {
            memcpy(dst, src, (size_t)width * dst_size);
        } else if (dst_bf16) {
            for (long j = 0; j < width; j++) ((uint16_t *)dst)[j] = f32_to_bf16(((const float *)src)[j]);
        } else {
            for (long j = 0; j < width; j++) ((float *)dst)[j] = bf16_to_f32(((const uint16_t *)src)[j]);
        }
    }
    return bad;
}
