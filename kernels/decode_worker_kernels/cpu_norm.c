/* RMS normalisation over a float64 residual stream, for CPU: optionally add a layer's output into the stream (in
 * place) first, then write the normalised rows times the weight, as float32 or rounded once to bf16. The stream is
 * the sum of every layer's output; keeping it in float64 while the layers run in float32 or bf16 spares that sum its
 * rounding, which float32 parity with transformers (1e-4 on the logits) would otherwise spend half of. */
#include "cpu_native.h"

typedef double v16d __attribute__((vector_size(128)));

/* h: [rows][dim] float64, updated in place when delta is not NULL; delta and weight: float32 or bf16 (flags 1 and 2);
 * out: float32 or bf16 (flag 4). dim % 16 == 0. */
void rms_norm(double *h, const void *delta, const void *weight, int64_t rows, int64_t dim, double eps, void *out,
              int flags) {
    const int delta_bf16 = flags & 1, weight_bf16 = (flags >> 1) & 1, out_bf16 = (flags >> 2) & 1;
    const int64_t delta_elem = delta_bf16 ? 2 : 4, weight_elem = weight_bf16 ? 2 : 4, out_elem = out_bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) if (rows * dim >= 1 << 16)
    for (int64_t r = 0; r < rows; r++) {
        double *row = h + r * dim;
        v16d squares = {};
        for (int64_t i = 0; i < dim; i += LANES) {
            v16d x;
            memcpy(&x, row + i, sizeof x);
            if (delta != NULL) {
                x += __builtin_convertvector(load16((const char *)delta + (r * dim + i) * delta_elem, delta_bf16), v16d);
                memcpy(row + i, &x, sizeof x);
            }
            squares += x * x;
        }
        double sum = 0;
        for (int i = 0; i < LANES; i++) sum += squares[i];
        const double inv = 1.0 / sqrt(sum / (double)dim + eps);
        for (int64_t i = 0; i < dim; i += LANES) {
            v16d x;
            memcpy(&x, row + i, sizeof x);
            const v16d w = __builtin_convertvector(load16((const char *)weight + i * weight_elem, weight_bf16), v16d);
            store16((char *)out + (r * dim + i) * out_elem, __builtin_convertvector(x * inv * w, v16f), out_bf16);
        }
    }
}
