/* What the native CPU kernels share: 16-lane float32 vectors and float32 / bf16 loads and stores of 16 values. */
#ifndef CPU_NATIVE_H
#define CPU_NATIVE_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define LANES 16

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16f load_f32(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does for finite values */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* 16 values from p, float32 or bf16, widened to float32 (exact). */
static inline v16f load16(const void *p, int bf16) {
    if (!bf16) return load_f32((const float *)p);
#if defined(__AVX512F__)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#else
    v16f v;
    for (int i = 0; i < LANES; i++) v[i] = bf16_to_f32(((const uint16_t *)p)[i]);
    return v;
#endif
}

/* 16 values to p, as float32 or rounded to bf16. */
static inline void store16(void *p, v16f v, int bf16) {
    if (!bf16) { memcpy(p, &v, sizeof v); return; }
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
    for (int i = 0; i < LANES; i++) ((uint16_t *)p)[i] = f32_to_bf16(v[i]);
#endif
}

/* e^x within two ulp for x in [-104, 88] (clamped there: 0 below, float32's largest powers above). */
static inline v16f exp16(v16f x) {
#if defined(__AVX512F__)
    x = _mm512_min_ps(_mm512_max_ps((__m512)x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.0f));
    const v16f n = _mm512_roundscale_ps((__m512)(x * 1.44269504088896341f),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const v16f r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;  /* ln 2 in two parts */
    v16f p = r * (1.0f / 5040) + (1.0f / 720);
    p = p * r + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return (v16f)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
    for (int i = 0; i < LANES; i++) x[i] = expf(x[i] < -104.0f ? -104.0f : x[i] > 88.0f ? 88.0f : x[i]);
    return x;
#endif
}

#endif
