/* The decoder layers' C loop (layer_driver.h; why and how: runner/layer_driver.py). It calls the other
   kernels directly: they are linked into the same library. */
#include <string.h>

#include "layer_driver.h"
#include "layer_ops.h"
#include "panel_gemm.h"
#include "tree_attention.h"

/* dims: t tokens, D hidden, H heads, G key/value heads, d head size, I intermediate, L cache slots per
   row, R cache rows. w[8 * i ...]: layer i's fused q/k/v panels, o panels, fused gate/up panels, down
   panels, input norm weight, post-attention norm weight, key cache, value cache. h [t, D] (residual
   stream, updated in place), out [t, D], scratch: see below. */
int tr_decoder_layers(const int64_t *dims, float *const *w, int64_t nlayers, float *h, const float *cos,
                      const float *sin, const int64_t *rows, const int64_t *slots, const int64_t *qrows,
                      const int64_t *qprefix, const uint8_t *vis, int64_t W, const float *final_norm, float *out,
                      float *scratch, float eps, float scale, int nthreads) {
    const int64_t t = dims[0], D = dims[1], H = dims[2], G = dims[3], d = dims[4], I = dims[5], L = dims[6];
    const int64_t R = dims[7];
    const int64_t Q = H * d, QKV = (H + 2 * G) * d;
    float *x = scratch, *qkv = x + t * D, *qc = qkv + t * QKV, *o = qc + t * Q, *tmp = o + t * Q;
    float *gu = tmp + t * D, *act = gu + t * 2 * I, *pend = act + t * I;
    const float *delta = NULL;  /* the previous layer's MLP output, added by this layer's first norm */
    int rc = 0;
    for (int64_t i = 0; i < nlayers; i++) {
        float *const *lw = w + 8 * i;
        rc |= tr_add_rms_norm(h, D, delta, D, x, D, lw[4], t, D, eps, nthreads);
        rc |= tr_panel_gemm(x, D, lw[0], qkv, QKV, t, D, QKV / 16, nthreads);
        rc |= tr_rope_store(qkv, QKV, qkv + Q, QKV, qkv + Q + G * d, QKV, cos, sin, t, H, G, d, lw[6], lw[7], L, R,
                            rows, slots, nthreads);
        for (int64_t r = 0; r < t; r++) memcpy(qc + r * Q, qkv + r * QKV, sizeof(float) * Q);
        rc |= tr_tree_attention(qc, o, lw[6], lw[7], G * L * d, L * d, R, L, qrows, qprefix, vis, W, t, H, G, d,
                                scale, nthreads);
        rc |= tr_panel_gemm(o, Q, lw[1], tmp, D, t, Q, D / 16, nthreads);
        rc |= tr_add_rms_norm(h, D, tmp, D, x, D, lw[5], t, D, eps, nthreads);
        rc |= tr_panel_gemm(x, D, lw[2], gu, 2 * I, t, D, 2 * I / 16, nthreads);
        rc |= tr_silu_mul(gu, 2 * I, gu + I, 2 * I, act, t, I, nthreads);
        rc |= tr_panel_gemm(act, I, lw[3], pend, D, t, I, D / 16, nthreads);
        delta = pend;
        if (rc) return rc;
    }
    return tr_add_rms_norm(h, D, delta, D, out, D, final_norm, t, D, eps, nthreads);
}
