/* SwiGLU's activation for CPU: out = silu(gate) * up over a fused gate-up projection's rows, in float32 with one
 * rounding to the output's dtype (torch rounds bf16 twice: after the silu and after the product). */
#include "cpu_native.h"

/* gate_up: [rows][2 * width] (gate, then up), float32 or bf16 (flag 1); out: [rows][width] in the same dtype.
 * width % 16 == 0. */
void silu_mul(const void *gate_up, int64_t rows, int64_t width, void *out, int flags) {
    const int bf16 = flags & 1;
    const int64_t elem = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) if (rows * width >= 1 << 16)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)gate_up + r * 2 * width * elem, *up = gate + width * elem;
        char *dst = (char *)out + r * width * elem;
        for (int64_t i = 0; i < width; i += LANES) {
            const v16f g = load16(gate + i * elem, bf16);
            store16(dst + i * elem, g / (1.0f + exp16(-g)) * load16(up + i * elem, bf16), bf16);
        }
    }
}
