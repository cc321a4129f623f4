/* One pass of StreamedAdamW's host update over a run of elements: AdamW on the fp32 master with
 * bf16 moments, the moments stored back by stochastic (or nearest) rounding, and the new weight
 * written in the device weight's dtype.
 *
 * Why a C loop: the torch path makes about a dozen elementwise passes per tile (unpack the
 * gradient and the moments, the fused AdamW kernel, the rounding passes, the weight write-back);
 * here each element is read once and written once, 20 bytes per parameter with bf16 gradients
 * and weights, which is what the host's memory bandwidth bounds.
 *
 * The arithmetic is torch's fused CPU AdamW (aten FusedAdamKernel, ADAMW mode, float path) written
 * out in the same order: the gradient divided by the clip scale; the master decayed by
 * (1 - lr*wd); m = fma(1 - beta1, g - m, m); v = fma((1 - beta2)*g, g, v*beta2);
 * p = p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps). The two fused multiply-adds are where
 * torch's vectorised kernel has them (its lerp, and the compiler's contraction of the second
 * moment); built with -ffp-contract=off so the compiler fuses nothing else. The tests hold the
 * two paths bit-equal where torch runs its vector loop (its scalar tail may differ by an ulp).
 * Stochastic rounding is k3core.optim.stochastic_rounding's recipe: bf16 bits = (fp32 bits +
 * noise) >> 16, the noise read contiguously from the table (the caller cuts runs where it wraps).
 *
 * Compiled by k3core/optim/host_kernel.py (which says how it is cached) and called through ctypes,
 * which releases the GIL: the Python side splits a chunk into ranges for its threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float grad_scale;      /* divide gradients by this (clipping); 1: no clip */
    float decay;           /* 1 - lr * weight_decay; 1: no decay */
    float lerp_weight;     /* 1 - beta1 */
    float beta2;
    float sq_coef;         /* 1 - beta2 */
    float bc2_sqrt;        /* sqrt(1 - beta2^t) */
    float eps;
    float neg_step_size;   /* -lr / (1 - beta1^t) */
} k3_adamw_coef;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline uint16_t f32_to_bf16_nearest(float f) {
    uint32_t u = f32_bits(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? 0x7FC0u : rounded);
}

static inline uint16_t f32_to_bf16_stochastic(float f, int32_t noise) {
    return (uint16_t)((f32_bits(f) + (uint32_t)noise) >> 16);
}

/* Elements [0, n) of one run. grad: bf16 (grad_f32 = 0) or fp32; wout: bf16 (wout_f32 = 0) or
 * fp32. noise_m/noise_v point at the run's first draw and hold at least n draws (the caller
 * splits runs where the table wraps); NULL means round to nearest. The flags are compile-time
 * constants in each inlined copy below, so every combination is its own branch-free loop that
 * the compiler vectorises (and the clip division is only there when clipping scales). */
static inline __attribute__((always_inline)) void adamw_run(
    int64_t n, float *restrict master, uint16_t *restrict exp_avg, uint16_t *restrict exp_avg_sq,
    const void *restrict grad, void *restrict wout, const k3_adamw_coef *restrict c,
    const int32_t *restrict noise_m, const int32_t *restrict noise_v, const int grad_f32, const int wout_f32,
    const int stochastic, const int use_scale, const int apply_decay) {
    const float scale = c->grad_scale, decay = c->decay;
    const float lerp_weight = c->lerp_weight, beta2 = c->beta2, sq_coef = c->sq_coef;
    const float bc2_sqrt = c->bc2_sqrt, eps = c->eps, neg_step_size = c->neg_step_size;
    const uint16_t *restrict g16 = (const uint16_t *)grad;
    const float *restrict g32 = (const float *)grad;
    uint16_t *restrict w16 = (uint16_t *)wout;
    float *restrict w32 = (float *)wout;
    for (int64_t i = 0; i < n; i++) {
        float g = grad_f32 ? g32[i] : bf16_to_f32(g16[i]);
        if (use_scale) g = g / scale;
        float p = master[i];
        if (apply_decay) p = p * decay;
        float m = bf16_to_f32(exp_avg[i]);
        float v = bf16_to_f32(exp_avg_sq[i]);
        m = fmaf(lerp_weight, g - m, m);
        v = fmaf(sq_coef * g, g, v * beta2);
        p = p + (neg_step_size * m) / (sqrtf(v) / bc2_sqrt + eps);
        master[i] = p;
        exp_avg[i] = stochastic ? f32_to_bf16_stochastic(m, noise_m[i]) : f32_to_bf16_nearest(m);
        exp_avg_sq[i] = stochastic ? f32_to_bf16_stochastic(v, noise_v[i]) : f32_to_bf16_nearest(v);
        if (wout_f32)
            w32[i] = p;
        else
            w16[i] = f32_to_bf16_nearest(p);
    }
}

/* Case k runs the loop with flags (grad_f32, wout_f32, stochastic, use_scale, apply_decay) = the
 * bits of k, high to low: 32 specialised copies. */
#define K3_CASE(k)                                                                                     \
    case k:                                                                                            \
        adamw_run(n, master, exp_avg, exp_avg_sq, grad, wout, c, noise_m, noise_v, ((k) >> 4) & 1,     \
                  ((k) >> 3) & 1, ((k) >> 2) & 1, ((k) >> 1) & 1, (k) & 1);                            \
        break;
#define K3_CASES4(k) K3_CASE(k) K3_CASE(k + 1) K3_CASE(k + 2) K3_CASE(k + 3)

void k3_adamw_bf16_moments(int64_t n, float *restrict master, uint16_t *restrict exp_avg,
                           uint16_t *restrict exp_avg_sq, const void *restrict grad, int32_t grad_f32,
                           void *restrict wout, int32_t wout_f32, const k3_adamw_coef *restrict c,
                           const int32_t *restrict noise_m, const int32_t *restrict noise_v) {
    /* a unit scale or decay skips its operation: x / 1 and x * 1 are x, so skipping is exact */
    const int k = (!!grad_f32 << 4) | (!!wout_f32 << 3) | ((noise_m != 0) << 2) | ((c->grad_scale != 1.0f) << 1) |
                  (c->decay != 1.0f);
    switch (k) {
        K3_CASES4(0) K3_CASES4(4) K3_CASES4(8) K3_CASES4(12)
        K3_CASES4(16) K3_CASES4(20) K3_CASES4(24) K3_CASES4(28)
    }
}
