/* Helpers shared by the CPU kernels in this directory: float32 / bfloat16 / float8 e5m2 loads as float32,
 * float32 -> bfloat16 and, with AVX-512, 16-lane masks, loads, bfloat16 rounding and polynomial exps. Included by
 * paged_attention.c and cpu_ops.c; asyncengine/cpu/build.py hashes this file into both
 * libraries' cache keys. */
#ifndef ASYNCENGINE_CPU_COMMON_H
#define ASYNCENGINE_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* 1 on AMD Zen 4 (cpu/build.py defines ASYNCENGINE_AMD_CPU and ASYNCENGINE_CPU_FAMILY on AMD CPUs; family
 * 25 with AVX-512 is Zen 4, Zen 3 builds the portable kernels), for the choices measured there: its 512-bit
 * instructions run on 256-bit units and its L1 is 32 KiB, where Zen 5's are full width and 48 KiB. */
#if defined(ASYNCENGINE_AMD_CPU) && ASYNCENGINE_CPU_FAMILY == 25
#define CPU_ZEN4 1
#else
#define CPU_ZEN4 0
#endif

static inline float load_f32(float x) { return x; }

/* n bytes from p on into every cache level, one prefetch per 64-byte line. */
static inline void prefetch_bytes(const void *p, int n) {
    for (int o = 0; o < n; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* float8 e5m2 (the KV cache's kv_cache_dtype=fp8_e5m2) is the top byte of an IEEE half: exact widening. */
static inline float e5m2_to_f32(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80) << 24, exp = (b >> 2) & 0x1f, man = b & 3;
    if (!exp) { /* zero or subnormal: man * 2^-16 */
        const float f = (float)man * 1.52587890625e-05f;
        return sign ? -f : f;
    }
    const uint32_t u =
        sign | (exp == 0x1f ? 0x7f800000u : (exp + 112) << 23) | (man << 21); /* 112 = 127 - 15 */
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_AVX512 1

static inline __mmask16 mask_upto(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
static inline __mmask32 mask32_upto(int n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n) - 1); }

/* 16 float32 values, zero where the mask is off. */
static inline __m512 load16_f32(const float *p, __mmask16 mk) { return _mm512_maskz_loadu_ps(mk, p); }

/* A vector the caller loaded and means to reuse from its register: GCC otherwise may fold the load into
 * every instruction that uses it, one load per use (the prompt-attention kernels' K / V vectors, used once
 * per query row: 20 loads per 16 FMAs, past the two loads a cycle this CPU issues). */
#define KEEP_IN_REGISTER(x) __asm__("" : "+v"(x))

/* 16 lanes rounded to bfloat16 bits as f32_to_bf16 rounds (nearest even; a NaN stays a quiet NaN) */
static inline __m512i bf16_bits(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_or_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_srli_epi32(u, 16),
                                _mm512_set1_epi32(0x40));
}
/* 16 lanes to bfloat16 bits. With AVX512-BF16, vcvtneps2bf16 rounds the same way (nearest even, NaN
 * quieted) in one instruction, except that it flushes denormal inputs to zero: a vector holding one
 * (vfpclassps says so) takes bf16_bits instead. */
static inline __m256i bf16_pack(__m512 x) {
#ifdef __AVX512BF16__
    if (__builtin_expect(!_mm512_fpclass_ps_mask(x, 0x20), 1)) return (__m256i)_mm512_cvtneps_pbh(x);
#endif
    return _mm512_cvtepi32_epi16(bf16_bits(x));
}
#ifdef __AVX512BF16__
/* Two vectors' lanes as bfloat16 pairs: lane i's 32-bit word holds bf16(e0[i]) low, bf16(e1[i]) high (one
 * rounding of both, [e0 | e1] as 32 bfloat16, then interleaved), the operand a vdpbf16ps takes to add the
 * products of two keys at once. */
static inline __m512i bf16_pairs(__m512 e0, __m512 e1) {
    /* clang-format off */
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    /* clang-format on */
    return _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
}
#endif
/* 16 lanes rounded to bfloat16 and widened back: the values a bfloat16 tensor would hold */
static inline __m512 bf16_round(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack(x)), 16));
}

/* 32 bf16 values (one 64-byte vector of uint16 pairs) as float32 without widening shuffles: the even
 * elements by a 16-bit shift, the odd ones by masking off the low half of each pair. */
static inline __m512 bf16_even_f32(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
static inline __m512 bf16_odd_f32(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* 16 bf16 values (zero where the mask is off) widened to float32 in registers: a 16-bit shift. */
static inline __m512 load16_bf16(const uint16_t *p, __mmask16 mk) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, p)), 16));
}

/* 16 e5m2 bytes as float32: widened to half (a byte shift), then vcvtph2ps. */
static inline __m512 load16_e5m2(const uint8_t *p, __mmask16 mk) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mk, p)), 8));
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

/* exp(x), 16 lanes, Cephes' expf polynomial (~1 ulp); ~0 below -87, inf above 88 (scalef overflows). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(127.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* x - n ln2, in two parts */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n); /* p * 2^n */
}

/* 2^(y - 1/2), 16 lanes, for a softmax's exponents (already in base 2; the caller folds the 1/2 into the
 * maximum it subtracts): r = y - floor(y) in one vreduceps, a degree-5 polynomial for 2^(r - 1/2) on
 * [0, 1) fitted for relative error (1.7e-7 at most in float32), and vscalefps multiplies by 2^floor(y).
 * The shift keeps the polynomial's argument centred as round-to-nearest would (the same accuracy as a
 * fit of 2^r on [-1/2, 1/2]) while the integer part is vscalefps's own floor: 7 instructions. 0 below
 * ~-149, inf above 128; NaN for an infinite y (callers mask such lanes). */
#if defined(__AVX512DQ__) /* vreduceps */
static inline __m512 exp2h_512(__m512 y) {
    const __m512 r = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(1.3276454993e-03f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.3564223237e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(3.9475172758e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6981424391e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.9013322592e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(7.0710670948e-01f));
    return _mm512_scalef_ps(p, y);
}
#endif
#endif

#endif
