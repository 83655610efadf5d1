/* RMS normalisation over a float32 residual stream, for CPU: optionally add a layer's output into the stream (in
 * place) first, then write the normalised rows times the weight, as float32 or rounded once to bf16. Keeping the
 * stream in float32 while the layers run in bf16 spares the model thirty layers of bf16 rounding of the sum. */
#include <math.h>

#include "cpu_native.h"

/* h: [rows][dim] float32, updated in place when delta is not NULL; delta and weight: float32 or bf16 (flags 1 and 2);
 * out: float32 or bf16 (flag 4). dim % 16 == 0. */
void rms_norm(float *h, const void *delta, const void *weight, int64_t rows, int64_t dim, float eps, void *out,
              int flags) {
    const int delta_bf16 = flags & 1, weight_bf16 = (flags >> 1) & 1, out_bf16 = (flags >> 2) & 1;
    const int64_t delta_elem = delta_bf16 ? 2 : 4, weight_elem = weight_bf16 ? 2 : 4, out_elem = out_bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) if (rows * dim >= 1 << 16)
    for (int64_t r = 0; r < rows; r++) {
        float *row = h + r * dim;
        v16f squares = {};
        for (int64_t i = 0; i < dim; i += LANES) {
            v16f x = load_f32(row + i);
            if (delta != NULL) {
                x += load16((const char *)delta + (r * dim + i) * delta_elem, delta_bf16);
                memcpy(row + i, &x, sizeof x);
            }
            squares += x * x;
        }
        float sum = 0;
        for (int i = 0; i < LANES; i++) sum += squares[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i += LANES) {
            const v16f w = load16((const char *)weight + i * weight_elem, weight_bf16);
            store16((char *)out + (r * dim + i) * out_elem, load_f32(row + i) * inv * w, out_bf16);
        }
    }
}
