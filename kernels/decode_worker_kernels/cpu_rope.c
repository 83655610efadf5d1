/* Rotary embedding and KV store for CPU, one pass over a layer's fused QKV projection: each token's query heads are
 * rotated into q_out, its key heads rotated and its value heads copied straight into their pool slot. The rotation is
 * rotate-half with full-width per-token tables (cos = [cos, cos], sin = [-sin, sin]): out = x * cos + roll(x, D/2) *
 * sin, in float32, rounded once to the destination's dtype. */
#include "cpu_native.h"

/* One head of D values (D % 32 == 0) from src, rotated into dst. */
static inline void rotate_head(const char *src, int src_bf16, const float *cos, const float *sin, int64_t head_dim,
                               char *dst, int dst_bf16) {
    const int64_t chunks = head_dim / LANES, half = chunks / 2, src_elem = src_bf16 ? 2 : 4, dst_elem = dst_bf16 ? 2 : 4;
    for (int64_t c = 0; c < chunks; c++) {
        const v16f x = load16(src + c * LANES * src_elem, src_bf16);
        const v16f partner = load16(src + ((c + half) % chunks) * LANES * src_elem, src_bf16);
        const v16f out = x * load_f32(cos + c * LANES) + partner * load_f32(sin + c * LANES);
        store16(dst + c * LANES * dst_elem, out, dst_bf16);
    }
}

static inline void copy_head(const char *src, int src_bf16, int64_t head_dim, char *dst, int dst_bf16) {
    const int64_t src_elem = src_bf16 ? 2 : 4, dst_elem = dst_bf16 ? 2 : 4;
    for (int64_t c = 0; c < head_dim / LANES; c++)
        store16(dst + c * LANES * dst_elem, load16(src + c * LANES * src_elem, src_bf16), dst_bf16);
}

/* qkv: [tokens][(q_heads + 2 kv_heads) * head_dim]; cos, sin: [tokens][head_dim] float32; q_out: [tokens][q_heads]
 * [head_dim] in qkv's dtype; slots[t] = page * page_size + offset; a page is [page_size][kv_heads][head_dim], pages
 * page_stride elements apart. flags: 1 qkv bf16, 2 pool bf16. Returns 0, or -1 when a slot is outside the pool (that
 * token's K/V are not written). */
int rope_store(const void *qkv, int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim, const float *cos,
               const float *sin, void *q_out, void *k_pages, void *v_pages, int64_t k_page_stride,
               int64_t v_page_stride, int64_t num_pages, int64_t page_size, const int64_t *slots, int flags) {
    const int qkv_bf16 = flags & 1, kv_bf16 = (flags >> 1) & 1;
    const int64_t elem = qkv_bf16 ? 2 : 4, kv_elem = kv_bf16 ? 2 : 4, width = (q_heads + 2 * kv_heads) * head_dim;
    int status = 0;
    #pragma omp parallel for schedule(static) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const char *row = (const char *)qkv + t * width * elem;
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < q_heads; h++)
            rotate_head(row + h * head_dim * elem, qkv_bf16, c, s, head_dim,
                        (char *)q_out + (t * q_heads + h) * head_dim * elem, qkv_bf16);
        const int64_t page = slots[t] / page_size, offset = slots[t] % page_size;
        if (slots[t] < 0 || page >= num_pages) { status = -1; continue; }
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t slot = offset * kv_heads + h;
            rotate_head(row + (q_heads + h) * head_dim * elem, qkv_bf16, c, s, head_dim,
                        (char *)k_pages + (page * k_page_stride + slot * head_dim) * kv_elem, kv_bf16);
            copy_head(row + (q_heads + kv_heads + h) * head_dim * elem, qkv_bf16, head_dim,
                      (char *)v_pages + (page * v_page_stride + slot * head_dim) * kv_elem, kv_bf16);
        }
    }
    return status;
}
