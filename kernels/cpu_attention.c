/* Paged decode attention for CPU: one new query per request reads its K/V straight from the pool's pages through
 * its page-table row, with no gathered copy and no mask (a short extend passes each new token as a request of its own
 * length). A task takes a request's kv head, or several (see paged_decode_attention), with each head's GQA group of
 * queries together, so each K/V row is loaded once for the group. Scores, softmax and the weighted sum run in
 * float32 with an online softmax over chunks of up to 16 slots (one vector of scores); K/V and queries are
 * float32 or bf16, the output float32 or bf16.
 *
 * Layout (as decode_worker.cache.pool): a page is [page_size][kv_heads][head_dim], contiguous; pages are
 * page_stride elements apart. Query and output are [batch][q_heads][head_dim], contiguous.
 */
#include <omp.h>

#include "cpu_native.h"

#define MAX_GROUP 16  /* query rows a task holds: a kv head's group, or several whole groups */
#define MAX_CHUNKS 16  /* head_dim up to 256 */

static inline float hsum(v16f v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}

typedef struct {
    int64_t group, chunks, slot_bytes, chunk_bytes;
    int kv_bf16;
} Shape;

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

/* Scores of up to 16 slots (from kp, slot_bytes apart) for each query of the group; lanes past n are -inf. */
static void chunk_scores(const Shape *s, const v16f q[][MAX_CHUNKS], const char *kp, int64_t n, v16f *scores) {
    v16f dots[MAX_GROUP][LANES];
    for (int64_t j = 0; j < LANES; j++) {
        if (j >= n) {
            for (int64_t g = 0; g < s->group; g++) dots[g][j] = (v16f){};
            continue;
        }
        v16f k[MAX_CHUNKS];
        for (int64_t c = 0; c < s->chunks; c++) k[c] = load16(kp + j * s->slot_bytes + c * s->chunk_bytes, s->kv_bf16);
        for (int64_t g = 0; g < s->group; g++) {
            v16f dot = q[g][0] * k[0];
            for (int64_t c = 1; c < s->chunks; c++) dot += q[g][c] * k[c];
            dots[g][j] = dot;
        }
    }
    for (int64_t g = 0; g < s->group; g++) {
        scores[g] = sum_each(dots[g]);
        for (int64_t j = n; j < LANES; j++) scores[g][j] = -INFINITY;
    }
}

/* Fold a chunk's scores into the running maximum, denominator and weighted sum of V. */
static void chunk_accumulate(const Shape *s, v16f *scores, const char *vp, int64_t n, float *max, float *denom,
                             v16f acc[][MAX_CHUNKS]) {
    for (int64_t g = 0; g < s->group; g++) {
        float top = max[g];
        for (int64_t j = 0; j < n; j++) top = scores[g][j] > top ? scores[g][j] : top;
        const float rescale = max[g] == -INFINITY ? 0.0f : expf(max[g] - top);
        max[g] = top;
        scores[g] = exp16(scores[g] - top);
        for (int64_t j = n; j < LANES; j++) scores[g][j] = 0;
        denom[g] = denom[g] * rescale + hsum(scores[g]);
        for (int64_t c = 0; c < s->chunks; c++) acc[g][c] *= rescale;
    }
    for (int64_t j = 0; j < n; j++) {
        v16f v[MAX_CHUNKS];
        for (int64_t c = 0; c < s->chunks; c++) v[c] = load16(vp + j * s->slot_bytes + c * s->chunk_bytes, s->kv_bf16);
        for (int64_t g = 0; g < s->group; g++)
            for (int64_t c = 0; c < s->chunks; c++) acc[g][c] += scores[g][j] * v[c];
    }
}

static inline void prefetch(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
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
    const int64_t kv_elem = kv_bf16 ? 2 : 4, q_elem = q_bf16 ? 2 : 4, out_elem = out_bf16 ? 2 : 4;
    const Shape s = {q_heads / kv_heads, head_dim / LANES, kv_heads * head_dim * kv_elem, LANES * kv_elem, kv_bf16};
    int64_t heads_per_task = 1;
    if (batch >= 2 * omp_get_max_threads())
        for (int64_t n = MAX_GROUP / s.group; n >= 1; n--)
            if (kv_heads % n == 0) { heads_per_task = n; break; }
    int status = 0;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * kv_heads / heads_per_task; task++) {
        const int64_t b = task * heads_per_task / kv_heads, h0 = task * heads_per_task % kv_heads, len = seq_lens[b];
        const int64_t rows = heads_per_task * s.group;  /* query rows of this task: heads h0.. of the request */
        if (len < 0 || len > table_cols * page_size) { status = -1; continue; }
        v16f qs[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS], scores[MAX_GROUP];
        float max[MAX_GROUP], denom[MAX_GROUP];
        for (int64_t r = 0; r < rows; r++) {
            const char *row = (const char *)q + (b * q_heads + h0 * s.group + r) * head_dim * q_elem;
            for (int64_t c = 0; c < s.chunks; c++) {
                qs[r][c] = load16(row + c * LANES * q_elem, q_bf16) * scale;
                acc[r][c] = (v16f){};
            }
            max[r] = -INFINITY;
            denom[r] = 0;
        }
        int bad_page = 0;
        int64_t n;
        for (int64_t t = 0; t < len; t += n) {
            const int64_t page = table[b * table_stride + t / page_size], offset = t % page_size;
            if (page < 0 || page >= num_pages) { bad_page = 1; break; }
            n = page_size - offset < LANES ? page_size - offset : LANES;
            n = len - t < n ? len - t : n;
            const int64_t next = t / page_size + 1;
            if (offset == 0 && next * page_size < len) {  /* the next page is a random jump: start loading it now */
                const int64_t ahead = table[b * table_stride + next];
                if (ahead >= 0 && ahead < num_pages) {
                    prefetch((const char *)k + ahead * k_page_stride * kv_elem, page_size * s.slot_bytes);
                    prefetch((const char *)v + ahead * v_page_stride * kv_elem, page_size * s.slot_bytes);
                }
            }
            for (int64_t h = 0; h < heads_per_task; h++) {
                const int64_t slot = offset * kv_heads + h0 + h, g = h * s.group;
                chunk_scores(&s, qs + g, (const char *)k + (page * k_page_stride + slot * head_dim) * kv_elem, n,
                             scores + g);
                chunk_accumulate(&s, scores + g, (const char *)v + (page * v_page_stride + slot * head_dim) * kv_elem,
                                 n, max + g, denom + g, acc + g);
            }
        }
        if (bad_page) { status = -1; continue; }
        for (int64_t r = 0; r < rows; r++) {
            const float inv = denom[r] > 0 ? 1.0f / denom[r] : 0.0f;
            char *row = (char *)out + (b * q_heads + h0 * s.group + r) * head_dim * out_elem;
            for (int64_t c = 0; c < s.chunks; c++) store16(row + c * LANES * out_elem, acc[r][c] * inv, out_bf16);
        }
    }
    return status;
}
