/* Per-row statistics of a step's logits for CPU, in one pass each over the vocabulary: the first index of the
 * largest logit (greedy's pick, as torch's argmax breaks ties) and the log of the sum of exponentials (every chosen
 * token's log-probability is its logit minus it), accumulated in float64 so a 49K-token vocabulary's sum keeps
 * float32's precision in the result. */
#include "cpu_native.h"

typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));

/* logits: [rows][vocab] float32, rows stride apart; lse: [rows] float64; argmax: [rows] int64. */
void row_stats(const float *logits, int64_t rows, int64_t vocab, int64_t stride, double *lse, int64_t *argmax) {
    #pragma omp parallel for schedule(static) if (rows * vocab >= 1 << 18)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        float top = -INFINITY;
        int64_t at = 0, i = 0;
#if defined(__AVX512F__)
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i where = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                          14, 15);
        const int64_t vector_end = vocab < (1LL << 31) ? vocab / LANES * LANES : 0;  /* int32 lane indices */
        for (; i < vector_end; i += LANES) {
            const __m512 v = _mm512_loadu_ps(x + i);
            const __mmask16 higher = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  /* strictly: each lane keeps its first */
            best = _mm512_mask_blend_ps(higher, best, v);
            where = _mm512_mask_blend_epi32(higher, where, index);
            index = _mm512_add_epi32(index, _mm512_set1_epi32(LANES));
        }
        float lane_best[LANES];
        int32_t lane_at[LANES];
        _mm512_storeu_ps(lane_best, best);
        _mm512_storeu_si512(lane_at, where);
        at = vocab;
        for (int l = 0; l < LANES; l++)
            if (lane_best[l] > top || (lane_best[l] == top && lane_at[l] < at)) { top = lane_best[l]; at = lane_at[l]; }
        if (i == 0) at = 0;
#endif
        for (; i < vocab; i++)
            if (x[i] > top) { top = x[i]; at = i; }
        v8d sums = {};
        int64_t j = 0;
        for (; j + LANES <= vocab; j += LANES) {
            const v16f e = exp16(load_f32(x + j) - top);
            v8f low, high;
            memcpy(&low, &e, sizeof low);
            memcpy(&high, (const char *)&e + sizeof low, sizeof high);
            sums += __builtin_convertvector(low, v8d) + __builtin_convertvector(high, v8d);
        }
        double sum = 0;
        for (int l = 0; l < 8; l++) sum += sums[l];
        for (; j < vocab; j++) sum += exp((double)x[j] - top);
        lse[r] = top == -INFINITY ? -INFINITY : top + log(sum);  /* every logit -inf: so is the sum's log */
        argmax[r] = at;
    }
}
