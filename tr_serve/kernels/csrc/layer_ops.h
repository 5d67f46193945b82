/* A Llama layer's per-token glue: residual add + RMSNorm, rotary embedding + KV-cache store, SiLU-gated
   product (runner/layer_ops.py checks the arguments). */
#ifndef TR_LAYER_OPS_H
#define TR_LAYER_OPS_H

#include <stdint.h>

/* per row r < t: h[r] += delta[r] (when delta), out[r] = RMSNorm(h[r]) * w; 2 when D is not a multiple
   of 16 */
int tr_add_rms_norm(float *h, int64_t hs, const float *delta, int64_t ds, float *out, int64_t os,
                    const float *w, int64_t t, int64_t D, float eps, int nthreads);

/* rotates the queries in place, writes the rotated keys and the values to their cache slots; 2 for an
   odd D, 3 for a row or slot outside the cache */
int tr_rope_store(float *q, int64_t qs, const float *k, int64_t ks, const float *v, int64_t vs,
                  const float *cos, const float *sin, int64_t t, int64_t NQ, int64_t NK, int64_t D,
                  float *keys, float *values, int64_t L, int64_t R, const int64_t *rows, const int64_t *slots,
                  int nthreads);

/* out [t, I] = silu(gate) * up */
int tr_silu_mul(const float *g, int64_t gs, const float *u, int64_t us, float *out, int64_t t, int64_t I,
                int nthreads);

#endif
