/* Paged decode attention for CPU: one new query per request reads its K/V straight from the pool's pages through
 * its page-table row, with no gathered copy and no mask (a short extend passes each new token as a request of its own
 * length). A task takes a request's kv head, or several (see paged_decode_attention), with each head's GQA group of
 * queries together, so each K/V row is loaded once for the group. Scores, softmax and the weighted sum run in
 * float32 with an online softmax over chunks of up to 16 slots (one vector of scores); K/V and queries are
 * float32 or bf16, the output float32 or bf16.
 *
 * Where the CPU has AVX512-BF16, bf16 queries over bf16 K/V (head_dim a multiple of 32) take a faster path: q.k on
 * the bf16 dot-product instruction (exact products, float32 sums; the scale applied to the scores), and each V row
 * widened by a shift and a mask per 32 values, its even and odd dims in separate vectors, the weighted sums kept in
 * that order and put back in place at the end. The common head shapes are compiled with their sizes as constants.
 *
 * Layout (as decode_worker.cache.pool): a page is [page_size][kv_heads][head_dim], contiguous; pages are
 * page_stride elements apart. Query and output are [batch][q_heads][head_dim], contiguous.
 */
#include <omp.h>

#include "cpu_native.h"

#define MAX_GROUP 16  /* query rows a task holds: a kv head's group, or several whole groups */
#define MAX_CHUNKS 16  /* head_dim up to 256 */

static inline float hmax(v16f v) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)v);
#else
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
#endif
}

static inline float hsum(v16f v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}

#define INLINE static inline __attribute__((always_inline))

/* The sums of 16 vectors as one vector (lane j: the sum of dots[j]), by a transposing tree of adds rather than 16
 * horizontal sums. */
static inline v16f sum_each(const v16f *dots) {
#if defined(__AVX512F__)
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: (a, b, a, b) partial sums of dots[2i], dots[2i + 1] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps((__m512)dots[2 * i], (__m512)dots[2 * i + 1]),
                                 _mm512_unpackhi_ps((__m512)dots[2 * i], (__m512)dots[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: the lane's sums of dots[4i .. 4i + 3] (pairs moved as one) */
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return (v16f)_mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xdd));
#else
    v16f sums;
    for (int j = 0; j < LANES; j++) {
        sums[j] = 0;
        for (int i = 0; i < LANES; i++) sums[j] += dots[j][i];
    }
    return sums;
#endif
}

/* What every task reads: the call's arguments, checked and sized. */
typedef struct {
    const char *q, *k, *v;
    char *out;
    const int64_t *table, *seq_lens;
    int64_t k_page_stride, v_page_stride, num_pages, page_size, table_stride, table_cols, q_heads, kv_heads, head_dim;
    int64_t q_elem, kv_elem, out_elem, slot_bytes;
    float scale;
    int q_bf16, kv_bf16, out_bf16;
} Call;

/* Scores of up to 16 slots (from kp, slot_bytes apart) for each query of the group; lanes past n are -inf. */
INLINE void chunk_scores(const Call *a, const int64_t group, const int64_t chunks, const v16f q[][MAX_CHUNKS],
                         const char *kp, int64_t n, v16f *scores) {
    v16f dots[MAX_GROUP][LANES];
    for (int64_t j = 0; j < LANES; j++) {
        v16f k[MAX_CHUNKS];
        for (int64_t c = 0; c < chunks; c++)
            k[c] = j < n ? load16(kp + j * a->slot_bytes + c * LANES * a->kv_elem, a->kv_bf16) : (v16f){};
        for (int64_t g = 0; g < group; g++) {
            v16f dot = q[g][0] * k[0];
            for (int64_t c = 1; c < chunks; c++) dot += q[g][c] * k[c];
            dots[g][j] = dot;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        scores[g] = sum_each(dots[g]);
        for (int64_t j = n; j < LANES; j++) scores[g][j] = -INFINITY;
    }
}

/* Fold a chunk's scores (lanes past n -inf) into the running maximum and denominator; scores become the weights
 * (0 past n). */
INLINE void chunk_softmax(const int64_t group, const int64_t chunks, v16f *scores, int64_t n, float *max, float *denom,
                          v16f acc[][MAX_CHUNKS]) {
    for (int64_t g = 0; g < group; g++) {
        const float top = fmaxf(max[g], hmax(scores[g]));
        const float rescale = max[g] == -INFINITY ? 0.0f : expf(max[g] - top);
        max[g] = top;
        scores[g] = exp16(scores[g] - top);
        for (int64_t j = n; j < LANES; j++) scores[g][j] = 0;
        denom[g] = denom[g] * rescale + hsum(scores[g]);
        for (int64_t c = 0; c < chunks; c++) acc[g][c] *= rescale;
    }
}

/* Add the chunk's n V rows, weighted, into the group's sums. */
INLINE void chunk_values(const Call *a, const int64_t group, const int64_t chunks, const v16f *weights,
                         const char *vp, int64_t n, v16f acc[][MAX_CHUNKS]) {
    for (int64_t j = 0; j < n; j++) {
        v16f v[MAX_CHUNKS];
        for (int64_t c = 0; c < chunks; c++) v[c] = load16(vp + j * a->slot_bytes + c * LANES * a->kv_elem, a->kv_bf16);
        for (int64_t g = 0; g < group; g++)
            for (int64_t c = 0; c < chunks; c++) acc[g][c] += weights[g][j] * v[c];
    }
}

#if defined(__AVX512BF16__)
/* 32 bf16 values as two float32 vectors: the even-indexed values, then the odd ones. */
INLINE void widen_pairs(__m512i pairs, v16f *even, v16f *odd) {
    *even = (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    *odd = (v16f)_mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
}

/* chunk_scores for bf16 queries (raw pairs, unscaled) and K: each dot on the bf16 dot-product instruction. */
INLINE void chunk_scores_bf16(const Call *a, const int64_t group, const int64_t chunks, const __m512i q[][MAX_CHUNKS / 2],
                              const char *kp, int64_t n, v16f *scores) {
    for (int64_t g = 0; g < group; g++) {
        v16f dots[LANES];
        for (int64_t j = 0; j < LANES; j++) {
            __m512 dot = _mm512_setzero_ps();
            if (j < n)
                for (int64_t p = 0; p < chunks / 2; p++)
                    dot = _mm512_dpbf16_ps(dot, (__m512bh)q[g][p],
                                           (__m512bh)_mm512_loadu_si512(kp + j * a->slot_bytes + p * 64));
            dots[j] = (v16f)dot;
        }
        scores[g] = sum_each(dots) * a->scale;
        for (int64_t j = n; j < LANES; j++) scores[g][j] = -INFINITY;
    }
}

/* chunk_values for bf16 V: sums in (even dims, odd dims) order per 32 dims. */
INLINE void chunk_values_bf16(const Call *a, const int64_t group, const int64_t chunks, const v16f *weights,
                              const char *vp, int64_t n, v16f acc[][MAX_CHUNKS]) {
    for (int64_t j = 0; j < n; j++) {
        v16f v[MAX_CHUNKS];
        for (int64_t p = 0; p < chunks / 2; p++)
            widen_pairs(_mm512_loadu_si512(vp + j * a->slot_bytes + p * 64), &v[2 * p], &v[2 * p + 1]);
        for (int64_t g = 0; g < group; g++)
            for (int64_t c = 0; c < chunks; c++) acc[g][c] += weights[g][j] * v[c];
    }
}

/* Sums in (even, odd) order back to dims in place, two vectors at a time. */
INLINE void interleave_pairs(v16f *acc, const int64_t chunks) {
    const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t p = 0; p < chunks / 2; p++) {
        const __m512 even = (__m512)acc[2 * p], odd = (__m512)acc[2 * p + 1];
        acc[2 * p] = (v16f)_mm512_permutex2var_ps(even, low, odd);
        acc[2 * p + 1] = (v16f)_mm512_permutex2var_ps(even, high, odd);
    }
}
#define HAS_BF16_PATH 1
#else
#define HAS_BF16_PATH 0
#endif

static inline void prefetch(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* Start loading a page's K and V (a random jump from the page before); an index out of range loads nothing. */
INLINE void prefetch_page(const Call *a, int64_t page) {
    if (page < 0 || page >= a->num_pages) return;
    prefetch(a->k + page * a->k_page_stride * a->kv_elem, a->page_size * a->slot_bytes);
    prefetch(a->v + page * a->v_page_stride * a->kv_elem, a->page_size * a->slot_bytes);
}

/* Request b's kv heads h0 .. h0 + heads - 1, each with its group of queries: 0, or -1 for a bad page or length.
 * bf16 (a constant) takes the AVX512-BF16 path; group and chunks are constants for the common head shapes. */
INLINE int attend_task(const Call *a, const int bf16, const int64_t group, const int64_t chunks, int64_t b, int64_t h0,
                       int64_t heads) {
    const int64_t len = a->seq_lens[b], rows = heads * group, page_size = a->page_size;
    if (len < 0 || len > a->table_cols * page_size) return -1;
    v16f qs[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS], scores[MAX_GROUP];
    float max[MAX_GROUP], denom[MAX_GROUP];
#if HAS_BF16_PATH
    __m512i q_pairs[MAX_GROUP][MAX_CHUNKS / 2];
#endif
    for (int64_t r = 0; r < rows; r++) {
        const char *row = a->q + (b * a->q_heads + h0 * group + r) * a->head_dim * a->q_elem;
        for (int64_t c = 0; c < chunks; c++) {
#if HAS_BF16_PATH
            if (bf16 && c % 2 == 0) q_pairs[r][c / 2] = _mm512_loadu_si512(row + c * LANES * a->q_elem);
#endif
            if (!bf16) qs[r][c] = load16(row + c * LANES * a->q_elem, a->q_bf16) * a->scale;
            acc[r][c] = (v16f){};
        }
        max[r] = -INFINITY;
        denom[r] = 0;
    }
    const int64_t *pages = a->table + b * a->table_stride;
    if (len > 0) prefetch_page(a, pages[0]);
    int64_t n;
    for (int64_t t = 0; t < len; t += n) {
        const int64_t page = pages[t / page_size], offset = t % page_size;
        if (page < 0 || page >= a->num_pages) return -1;
        n = page_size - offset < LANES ? page_size - offset : LANES;
        n = len - t < n ? len - t : n;
        const int64_t next = t / page_size + 1;
        if (offset == 0 && next * page_size < len) prefetch_page(a, pages[next]);
        for (int64_t h = 0; h < heads; h++) {
            const int64_t slot = offset * a->kv_heads + h0 + h, g = h * group;
            const char *kp = a->k + (page * a->k_page_stride + slot * a->head_dim) * a->kv_elem;
            const char *vp = a->v + (page * a->v_page_stride + slot * a->head_dim) * a->kv_elem;
#if HAS_BF16_PATH
            if (bf16) chunk_scores_bf16(a, group, chunks, q_pairs + g, kp, n, scores + g);
#endif
            if (!bf16) chunk_scores(a, group, chunks, qs + g, kp, n, scores + g);
            chunk_softmax(group, chunks, scores + g, n, max + g, denom + g, acc + g);
#if HAS_BF16_PATH
            if (bf16) chunk_values_bf16(a, group, chunks, scores + g, vp, n, acc + g);
#endif
            if (!bf16) chunk_values(a, group, chunks, scores + g, vp, n, acc + g);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
#if HAS_BF16_PATH
        if (bf16) interleave_pairs(acc[r], chunks);
#endif
        const float inv = denom[r] > 0 ? 1.0f / denom[r] : 0.0f;
        char *row = a->out + (b * a->q_heads + h0 * group + r) * a->head_dim * a->out_elem;
        for (int64_t c = 0; c < chunks; c++) store16(row + c * LANES * a->out_elem, acc[r][c] * inv, a->out_bf16);
    }
    return 0;
}

/* One task on the path and shape it takes: the common head shapes with constant sizes (SmolLM2's 3 queries per kv
 * head of 64 dims, Llama-3-8B's 4 of 128), the rest general. */
static int dispatch_task(const Call *a, int64_t group, int64_t chunks, int64_t b, int64_t h0, int64_t heads) {
#if HAS_BF16_PATH
    if (a->q_bf16 && a->kv_bf16 && chunks % 2 == 0) {
        if (group == 3 && chunks == 4) return attend_task(a, 1, 3, 4, b, h0, heads);
        if (group == 4 && chunks == 8) return attend_task(a, 1, 4, 8, b, h0, heads);
        return attend_task(a, 1, group, chunks, b, h0, heads);
    }
#endif
    if (group == 3 && chunks == 4) return attend_task(a, 0, 3, 4, b, h0, heads);
    return attend_task(a, 0, group, chunks, b, h0, heads);
}

/* flags: 1 query bf16, 2 K/V bf16, 4 output bf16. Returns 0; -1 when a page index is outside [0, num_pages) or a
 * length outside [0, table_cols * page_size] (that request's output is left unwritten); -2 for shapes it does not
 * take (head_dim not a multiple of 16 or over 256, a group over 16). A request of length 0 gets zeros.
 * A task is one request and as many of its kv heads as 16 query rows allow where the batch alone keeps every thread
 * busy (it then streams each page's slots whole, all heads together), else one kv head. */
int paged_decode_attention(const void *q, const void *k, const void *v, int64_t k_page_stride, int64_t v_page_stride,
                           int64_t num_pages, int64_t page_size, const int64_t *table, int64_t table_stride,
                           int64_t table_cols, const int64_t *seq_lens, int64_t batch, int64_t q_heads,
                           int64_t kv_heads, int64_t head_dim, float scale, void *out, int flags) {
    const int q_bf16 = flags & 1, kv_bf16 = (flags >> 1) & 1, out_bf16 = (flags >> 2) & 1;
    if (kv_heads <= 0 || q_heads % kv_heads || q_heads / kv_heads > MAX_GROUP || head_dim % LANES ||
        head_dim / LANES > MAX_CHUNKS || page_size <= 0)
        return -2;
    const int64_t kv_elem = kv_bf16 ? 2 : 4, group = q_heads / kv_heads, chunks = head_dim / LANES;
    const Call a = {q, k, v, out, table, seq_lens, k_page_stride, v_page_stride, num_pages, page_size, table_stride,
                    table_cols, q_heads, kv_heads, head_dim, q_bf16 ? 2 : 4, kv_elem, out_bf16 ? 2 : 4,
                    kv_heads * head_dim * kv_elem, scale, q_bf16, kv_bf16, out_bf16};
    int64_t heads_per_task = 1;
    if (batch >= 2 * omp_get_max_threads())
        for (int64_t n = MAX_GROUP / group; n >= 1; n--)
            if (kv_heads % n == 0) { heads_per_task = n; break; }
    int status = 0;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * kv_heads / heads_per_task; task++) {
        const int64_t b = task * heads_per_task / kv_heads, h0 = task * heads_per_task % kv_heads;
        if (dispatch_task(&a, group, chunks, b, h0, heads_per_task) != 0) status = -1;
    }
    return status;
}
