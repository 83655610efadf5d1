/* Low-bit weight matmuls for CPU: out[M][N] = x[M][K] @ W[N][K]^T with W kept as GGUF Q4_1 or Q8_0 blocks of 32
 * along K. Each block is dequantized to float32 exactly as the file defines it (d * q + m, d * q), once per group
 * of up to ROWS rows, and multiplied in float32, so the result is the dequantized matrix's matmul up to summation
 * order, while the weights stream from memory at 4.75 or 8.5 bits each. Sums run per block (even and odd k apart)
 * and then across blocks, which keeps float32's rounding as small as a blocked GEMM's.
 *
 * Weights are reordered at load into tiles of 16 output rows so that one vector holds one k for 16 outputs: no
 * horizontal sums, and x[r][k] is a broadcast. Q4_1 tile: per pair of k, 16 bytes (output i: k in the low nibble,
 * k + 1 in the high one); per block, 16 scales then 16 minimums. Q8_0 tile: per k, 16 signed bytes; per block, 16
 * scales. Activations and outputs are float32 or bf16 (flags). Threads: OpenMP over tiles (the process's runtime,
 * shared with torch).
 */
#include <stdlib.h>

#include "cpu_native.h"

#define BLOCK 32
#define ROWS 8

int native_abi(void) { return 2; }  /* the library's ABI, checked by cpu_native.py */

static inline v16u load_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16u)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    __m256i halves[2] = {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                         _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
    v16u v; memcpy(&v, halves, sizeof v); return v;
#else
    v16u v; for (int i = 0; i < LANES; i++) v[i] = p[i]; return v;
#endif
}

static inline v16f load_s8(const int8_t *p) {
#if defined(__AVX512F__)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))))};
    v16f v; memcpy(&v, halves, sizeof v); return v;
#else
    v16f v; for (int i = 0; i < LANES; i++) v[i] = p[i]; return v;
#endif
}

static void store_tile(const v16f *acc, int rows, void *out, int64_t ldo, int out_bf16) {
    for (int r = 0; r < rows; r++) store16((char *)out + r * ldo * (out_bf16 ? 2 : 4), acc[r], out_bf16);
}

/* The weights of k = 2j and 2j + 1 (within block b) for a tile's 16 outputs, exactly as the file defines them. */
static inline void q4_pair(const uint8_t *codes, const float *dm, int64_t b, int64_t j, v16f *w0, v16f *w1) {
    const v16f d = load_f32(dm + b * 2 * LANES), m = load_f32(dm + b * 2 * LANES + LANES);
    const v16u q = load_u8(codes + (b * BLOCK / 2 + j) * LANES);
    *w0 = __builtin_convertvector(q & 15, v16f) * d + m;
    *w1 = __builtin_convertvector(q >> 4, v16f) * d + m;
}

static inline void q8_pair(const uint8_t *codes, const float *d, int64_t b, int64_t j, v16f *w0, v16f *w1) {
    const v16f scale = load_f32(d + b * LANES);
    const int8_t *k = (const int8_t *)codes + (b * BLOCK + 2 * j) * LANES;
    *w0 = load_s8(k) * scale;
    *w1 = load_s8(k + LANES) * scale;
}

/* One tile (16 outputs) for R rows of x; R is a constant in each instance so the accumulators stay in registers.
   FORMAT##_pair gives each pair of k's weights. */
#define TILE(FORMAT, R)                                                                                              \
    static void FORMAT##_tile_##R(const float *x, int64_t K, const uint8_t *codes, const float *tables, void *out,   \
                                  int64_t ldo, int out_bf16) {                                                       \
        v16f acc[R];                                                                                                 \
        for (int r = 0; r < R; r++) acc[r] = (v16f){};                                                               \
        for (int64_t b = 0; b < K / BLOCK; b++) {                                                                    \
            v16f even[R], odd[R];                                                                                    \
            for (int r = 0; r < R; r++) even[r] = odd[r] = (v16f){};                                                 \
            for (int64_t j = 0; j < BLOCK / 2; j++) {                                                                \
                v16f w0, w1;                                                                                         \
                FORMAT##_pair(codes, tables, b, j, &w0, &w1);                                                        \
                const int64_t k = b * BLOCK + 2 * j;                                                                 \
                for (int r = 0; r < R; r++) {                                                                        \
                    even[r] += w0 * x[r * K + k];                                                                    \
                    odd[r] += w1 * x[r * K + k + 1];                                                                 \
                }                                                                                                    \
            }                                                                                                        \
            for (int r = 0; r < R; r++) acc[r] += even[r] + odd[r];                                                  \
        }                                                                                                            \
        store_tile(acc, R, out, ldo, out_bf16);                                                                      \
    }

TILE(q4, 1) TILE(q4, 2) TILE(q4, 3) TILE(q4, 4) TILE(q4, 5) TILE(q4, 6) TILE(q4, 7) TILE(q4, 8)
TILE(q8, 1) TILE(q8, 2) TILE(q8, 3) TILE(q8, 4) TILE(q8, 5) TILE(q8, 6) TILE(q8, 7) TILE(q8, 8)

typedef void (*tile_fn)(const float *, int64_t, const uint8_t *, const float *, void *, int64_t, int);
static const tile_fn q4_tiles[ROWS + 1] = {0, q4_tile_1, q4_tile_2, q4_tile_3, q4_tile_4,
                                           q4_tile_5, q4_tile_6, q4_tile_7, q4_tile_8};
static const tile_fn q8_tiles[ROWS + 1] = {0, q8_tile_1, q8_tile_2, q8_tile_3, q8_tile_4,
                                           q8_tile_5, q8_tile_6, q8_tile_7, q8_tile_8};

/* x as float32: itself, or a converted copy the caller frees (NULL if out of memory). */
static const float *as_f32(const void *x, int x_bf16, int64_t count, float **owned) {
    *owned = NULL;
    if (!x_bf16) return (const float *)x;
    float *f = malloc(count * sizeof(float));
    if (f == NULL) return NULL;
    int64_t i = 0;
    for (; i + LANES <= count; i += LANES) {
        const v16f v = load16((const uint16_t *)x + i, 1);
        memcpy(f + i, &v, sizeof v);
    }
    for (; i < count; i++) f[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    *owned = f;
    return f;
}

/* Every (tile, group of ROWS rows); a tile's codes and tables are tile_code_bytes and tile_table_floats long. */
static int run_tiles(const tile_fn *tiles, const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes,
                     int64_t tile_code_bytes, const float *tables, int64_t tile_table_floats, int64_t N, void *out,
                     int out_bf16) {
    float *owned;
    const float *xf = as_f32(x, x_bf16, M * K, &owned);
    if (xf == NULL) return -1;
    const size_t elem = out_bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N / LANES; t++) {
        for (int64_t r = 0; r < M; r += ROWS) {
            const int rows = M - r < ROWS ? (int)(M - r) : ROWS;
            tiles[rows](xf + r * K, K, codes + t * tile_code_bytes, tables + t * tile_table_floats,
                        (char *)out + (r * N + t * LANES) * elem, N, out_bf16);
        }
    }
    free(owned);
    return 0;
}

/* Return 0, or -1 when a bf16 input could not be converted (out of memory). N % 16 == 0, K % 32 == 0. */
int q4_1_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, const float *dm, int64_t N,
                void *out, int out_bf16) {
    return run_tiles(q4_tiles, x, x_bf16, M, K, codes, K / 2 * LANES, dm, K / BLOCK * 2 * LANES, N, out, out_bf16);
}

int q8_0_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *codes, const float *d, int64_t N,
                void *out, int out_bf16) {
    return run_tiles(q8_tiles, x, x_bf16, M, K, (const uint8_t *)codes, K * LANES, d, K / BLOCK * LANES, N, out,
                     out_bf16);
}
