/* The layer ops (layer_ops.h; why and how: runner/layer_ops.py). Compiled without contracted
   multiply-adds (the pragma comes first, so it covers vec.h's helpers too): the rotary embedding's
   products and sums round as torch's separate operations do. */
#pragma GCC optimize("fp-contract=off")
#include "layer_ops.h"
#include "vec.h"

static inline v16 pick(i16 m, v16 a, v16 b) { return (v16)(((i16)a & m) | ((i16)b & ~m)); } /* m ? a : b */

/* exp(x) (Cephes expf): 0 below -87.3, +inf above 88.72, NaN stays NaN */
static inline v16 vexp(v16 x) {
    i16 low = x < splat(-87.33654f), high = x > splat(88.72283f);
    v16 c = pick(x < splat(-87.0f), splat(-87.0f), x);
    c = pick(c > splat(88.0f), splat(88.0f), c);
    v16 y = exp_in_range(c);
    y = pick(low, splat(0.0f), y);
    return pick(high, splat(INFINITY), y);
}

/* per row r < t: h[r] += delta[r] (when delta), out[r] = w * (h[r] * (1 / sqrt(sum(h[r]^2) / D + eps))) */
int tr_add_rms_norm(float *h, int64_t hs, const float *delta, int64_t ds, float *out, int64_t os,
                    const float *w, int64_t t, int64_t D, float eps, int nthreads) {
    if (D % 16) return 2;
    #pragma omp parallel for num_threads(nthreads) if (t >= 32) schedule(static)
    for (int64_t r = 0; r < t; r++) {
        float *x = h + r * hs;
        if (delta) {
            const float *d = delta + r * ds;
            for (int64_t i = 0; i < D; i += 16) store16(x + i, load16(x + i) + load16(d + i));
        }
        v16 acc = (v16){0};
        for (int64_t i = 0; i < D; i += 16) { v16 v = load16(x + i); acc += v * v; }
        float inv = 1.0f / sqrtf(hsum(acc) / (float)D + eps);
        float *o = out + r * os;
        for (int64_t i = 0; i < D; i += 16) store16(o + i, load16(w + i) * (load16(x + i) * splat(inv)));
    }
    return 0;
}

/* rotate x [D] by cos/sin [D] as x * cos + rotate_half(x) * sin, into y (may be x); 16 pairs at a time
   where the halves allow (the same products and sums, so the same floats) */
static inline void rotate(const float *x, float *y, const float *c, const float *s, int64_t D) {
    const int64_t H = D / 2;
    int64_t i0 = 0;
    for (; i0 + 16 <= H; i0 += 16) {
        v16 a = load16(x + i0), b = load16(x + i0 + H);
        v16 lo = a * load16(c + i0) + (-b) * load16(s + i0);
        v16 hi = b * load16(c + i0 + H) + a * load16(s + i0 + H);
        store16(y + i0, lo);
        store16(y + i0 + H, hi);
    }
    for (int64_t i = i0; i < H; i++) {
        float a = x[i], b = x[i + H];
        y[i] = a * c[i] + (-b) * s[i];
        y[i + H] = b * c[i + H] + a * s[i + H];
    }
}

/* token j < t: NQ query heads at q + j * qs (rotated in place), NK key heads at k + j * ks, value
   heads at v + j * vs, each of D floats; cos/sin [t, D]. The rotated keys and the values go to
   slot slots[j] of cache row rows[j] of keys/values [R, NK, L, D]. Returns 2 for an odd D, 3 when a
   row or slot lies outside the cache (nothing written). */
int tr_rope_store(float *q, int64_t qs, const float *k, int64_t ks, const float *v, int64_t vs,
                  const float *cos, const float *sin, int64_t t, int64_t NQ, int64_t NK, int64_t D,
                  float *keys, float *values, int64_t L, int64_t R, const int64_t *rows, const int64_t *slots,
                  int nthreads) {
    if (D % 2) return 2;
    for (int64_t j = 0; j < t; j++)
        if (rows[j] < 0 || rows[j] >= R || slots[j] < 0 || slots[j] >= L) return 3;
    #pragma omp parallel for num_threads(nthreads) if (t >= 16) schedule(static)
    for (int64_t j = 0; j < t; j++) {
        const float *c = cos + j * D, *s = sin + j * D;
        for (int64_t h = 0; h < NQ; h++) rotate(q + j * qs + h * D, q + j * qs + h * D, c, s, D);
        for (int64_t h = 0; h < NK; h++) {
            int64_t at = ((rows[j] * NK + h) * L + slots[j]) * D;
            rotate(k + j * ks + h * D, keys + at, c, s, D);
            memcpy(values + at, v + j * vs + h * D, sizeof(float) * D);
        }
    }
    return 0;
}

/* out [t, I] = silu(gate) * up, silu(x) = x / (1 + exp(-x)); gate/up rows gs/us apart. Rows split
   between the threads from 2 rows (rope_store from 16, the norm from 32): measured per call, SmolLM2-135M's
   sizes, 2 threads, 16 rows: silu 13.2 -> 8.0 us, rope_store 8.9 -> 6.9 us; the norm gained nothing. */
int tr_silu_mul(const float *g, int64_t gs, const float *u, int64_t us, float *out, int64_t t, int64_t I,
                int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (t >= 2) schedule(static)
    for (int64_t r = 0; r < t; r++) {
        const float *a = g + r * gs, *b = u + r * us;
        float *o = out + r * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {
            v16 x = load16(a + i);
            v16 sx = x / (splat(1.0f) + vexp(-x));
            store16(o + i, sx * load16(b + i));
        }
        if (i < I) { /* the tail through the same vector code */
            float xa[16] = {0}, xb[16] = {0}, xo[16];
            memcpy(xa, a + i, sizeof(float) * (I - i));
            memcpy(xb, b + i, sizeof(float) * (I - i));
            v16 x = load16(xa);
            store16(xo, (x / (splat(1.0f) + vexp(-x))) * load16(xb));
            memcpy(o + i, xo, sizeof(float) * (I - i));
        }
    }
    return 0;
}
