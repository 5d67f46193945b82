/* The tree attention kernel (tree_attention.h; why and how: runner/tree_attention.py). */
#include "tree_attention.h"
#include "vec.h"

static inline v16 vmax(v16 a, v16 b) { i16 m = a < b; return (v16)(((i16)a & ~m) | ((i16)b & m)); }

/* exp(x) for x <= 0 (Cephes expf); lanes below -87 (masked slots are -inf) give 0 */
static inline v16 vexp(v16 x) {
    i16 dead = x < splat(-87.0f);
    x = vmax(x, splat(-87.0f));
    return (v16)((i16)exp_in_range(x) & ~dead);
}

/* a[j] = lane partials of key j's dot product: the 16 sums, in key order, in one vector. Four levels
   fold pairs of vectors (lanes end in bit-reversed key order), then one shuffle restores the order. */
static inline v16 transpose_sum16(v16 *a) {
    v16 b[8], c[4], d[2];
    for (int p = 0; p < 8; p++)
        b[p] = __builtin_shuffle(a[2 * p], a[2 * p + 1], (i16){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23})
             + __builtin_shuffle(a[2 * p], a[2 * p + 1], (i16){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int p = 0; p < 4; p++)
        c[p] = __builtin_shuffle(b[2 * p], b[2 * p + 1], (i16){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27})
             + __builtin_shuffle(b[2 * p], b[2 * p + 1], (i16){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
    for (int p = 0; p < 2; p++)
        d[p] = __builtin_shuffle(c[2 * p], c[2 * p + 1], (i16){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29})
             + __builtin_shuffle(c[2 * p], c[2 * p + 1], (i16){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    v16 e = __builtin_shuffle(d[0], d[1], (i16){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30})
          + __builtin_shuffle(d[0], d[1], (i16){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
    return __builtin_shuffle(e, (i16){0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15});
}

/* dot products of one head's query (DV vectors) with 16 consecutive keys [16][16 * DV] */
static inline __attribute__((always_inline)) v16 block16(const v16 *qh, const float *K, const int DV) {
    v16 a[16];
    for (int j = 0; j < 16; j++) {
        v16 acc = (v16){0};
        for (int c = 0; c < DV; c++) acc += qh[c] * load16(K + j * 16 * DV + 16 * c);
        a[j] = acc;
    }
    return transpose_sum16(a);
}

static __thread float *sbuf;
static __thread int64_t scap;

/* one query token's softmax weights over the slots it sees, for the NH heads that share key/value head
   g: s[h * Lp + j] = exp(scale * q_h . k_j - max_h), 0 for a new slot it does not see (vis[m] == 0);
   total[h] = their sum. s holds the scaled dot products of the P prefix slots and the W new slots
   (slots P + W to Lp are padding). Which other queries share the pass does not matter: every sum is
   taken in the same order. */
static inline __attribute__((always_inline)) void normalise(float *s, const int64_t P, const uint8_t *vis,
        const int64_t W, const int64_t Lp, float *total, const int NH) {
    const int64_t L = P + W;
    for (int64_t m = 0; m < W; m++)
        if (!vis[m]) for (int h = 0; h < NH; h++) s[h * Lp + P + m] = -INFINITY;
    for (int h = 0; h < NH; h++) {
        float *sh = s + h * Lp;
        for (int64_t j = L; j < Lp; j++) sh[j] = -INFINITY;
        v16 m = splat(-INFINITY);
        for (int64_t j = 0; j < Lp; j += 16) m = vmax(m, load16(sh + j));
        float mx = m[0];
        for (int l = 1; l < 16; l++) mx = mx > m[l] ? mx : m[l];
        v16 sum = (v16){0};
        for (int64_t j = 0; j < Lp; j += 16) {
            v16 e = vexp(load16(sh + j) - mx);
            store16(sh + j, e);
            sum += e;
        }
        total[h] = hsum(sum);
    }
}

/* the scaled dot products of NQ query tokens (q + i * qs) with the keys j < L, into s + i * NH * Lp:
   a block of 16 keys is read once for all of them (from L1 for all but the first) */
static inline __attribute__((always_inline)) void dots(const float *q, const int64_t qs, float *s, const float *K,
        const int64_t L, const int64_t Lp, const float scale, const int NH, const int DV, const int NQ) {
    const int64_t D = 16 * DV, L16 = L / 16 * 16;
    for (int64_t j0 = 0; j0 < L16; j0 += 16)  /* 16 keys at a time, sums transposed into one vector */
        for (int i = 0; i < NQ; i++) {
            v16 qv[NH][DV];
            for (int h = 0; h < NH; h++) for (int c = 0; c < DV; c++) qv[h][c] = load16(q + i * qs + h * D + 16 * c);
            for (int h = 0; h < NH; h++)
                store16(s + (i * NH + h) * Lp + j0, block16(qv[h], K + j0 * D, DV) * scale);
        }
    for (int i = 0; i < NQ; i++) {
        v16 qv[NH][DV];
        for (int h = 0; h < NH; h++) for (int c = 0; c < DV; c++) qv[h][c] = load16(q + i * qs + h * D + 16 * c);
        for (int64_t j = L16; j < L; j++) {
            const float *kj = K + j * D;
            v16 acc[NH];
            for (int h = 0; h < NH; h++) acc[h] = (v16){0};
            for (int c = 0; c < DV; c++) {
                v16 kv = load16(kj + 16 * c);
                for (int h = 0; h < NH; h++) acc[h] += qv[h][c] * kv;
            }
            for (int h = 0; h < NH; h++) s[(i * NH + h) * Lp + j] = hsum(acc[h]) * scale;
        }
    }
}

/* NQ query tokens of one cache row (same prefix P, consecutive in q and out, qs floats apart), the NH
   heads that share key/value head g: attention over the P prefix slots and the new slots each sees.
   K/V [L][D]. Each token's sums run in the same order as when it is alone (NQ = 1), so its result is
   the same bit for bit; NQ = 2 reads each key and value once for both (measured here, SmolLM2-135M's
   shapes, 30 layers, 2 threads: 16 query tokens 1.90 -> 1.77 ms at context 256, 7.50 -> 6.88 ms at
   1024; 4 tokens 2.53 -> 2.23 ms at 1024; one token unchanged). */
static inline __attribute__((always_inline)) int several(
        const float *q, float *out, const int64_t qs, const float *K, const float *V, const int64_t P,
        const uint8_t *vis, const int64_t W, const float scale, const int NH, const int DV, const int NQ) {
    const int64_t D = 16 * DV, L = P + W, Lp = (L + 15) / 16 * 16;
    if (NQ * NH * Lp > scap) {
        free(sbuf);
        sbuf = malloc(sizeof(float) * NQ * NH * Lp);
        scap = sbuf ? NQ * NH * Lp : 0;
        if (!sbuf) return 1;
    }
    float *s = sbuf;
    float total[NQ][NH];
    dots(q, qs, s, K, L, Lp, scale, NH, DV, NQ);
    for (int i = 0; i < NQ; i++) normalise(s + i * NH * Lp, P, vis + i * W, W, Lp, total[i], NH);
    v16 acc[NQ][NH][DV];
    for (int i = 0; i < NQ; i++) for (int h = 0; h < NH; h++) for (int c = 0; c < DV; c++) acc[i][h][c] = (v16){0};
    for (int64_t j = 0; j < P; j++) {  /* the prefix: every query sees it */
        const float *vj = V + j * D;
        for (int c = 0; c < DV; c++) {
            v16 vv = load16(vj + 16 * c);
            for (int i = 0; i < NQ; i++)
                for (int h = 0; h < NH; h++) acc[i][h][c] += s[(i * NH + h) * Lp + j] * vv;
        }
    }
    for (int64_t m = 0; m < W; m++) {  /* the new slots: each query those it sees */
        const float *vj = V + (P + m) * D;
        for (int i = 0; i < NQ; i++) {
            if (!vis[i * W + m]) continue;
            for (int c = 0; c < DV; c++) {
                v16 vv = load16(vj + 16 * c);
                for (int h = 0; h < NH; h++) acc[i][h][c] += s[(i * NH + h) * Lp + P + m] * vv;
            }
        }
    }
    for (int i = 0; i < NQ; i++)
        for (int h = 0; h < NH; h++)
            for (int c = 0; c < DV; c++) store16(out + i * qs + h * D + 16 * c, acc[i][h][c] / total[i][h]);
    return 0;
}

/* the shapes (NH heads per key/value head, DV = D / 16) compiled with constant sizes: the loops over
   heads, lanes and queries unroll into registers. PAIRED_SHAPES: those where two query tokens per pass
   still fit the registers (2 x NH x DV accumulators of the weighted sum); the others take one. */
#define SHAPES(X) X(1, 4) X(2, 4) X(3, 4) X(4, 4) X(8, 4) X(1, 8) X(2, 8) X(4, 8) X(8, 8)
#define PAIRED_SHAPES(X) X(1, 4) X(2, 4) X(3, 4) X(1, 8)

/* q, out: [T][H][D]; K/V of cache row r < R, key/value head g at kb + r * row_stride + g * head_stride,
   [L slots][D]; query i sees slots < prefix[i] and prefix[i] + m where vis[i * W + m].
   Returns 0, 1 when out of memory, 2 for shapes it does not take, 3 when a query's row or its prefix
   and the W new slots lie outside the cache. */
int tr_tree_attention(const float *q, float *out, const float *kb, const float *vb, int64_t row_stride,
                      int64_t head_stride, int64_t R, int64_t L, const int64_t *rows, const int64_t *prefix,
                      const uint8_t *vis, int64_t W, int64_t T, int64_t H, int64_t G, int64_t D, float scale,
                      int nthreads) {
    if (G <= 0 || H % G != 0 || D % 16 != 0) return 2;
    for (int64_t i = 0; i < T; i++)
        if (rows[i] < 0 || rows[i] >= R || prefix[i] < 0 || prefix[i] + W > L) return 3;
    const int NH = (int)(H / G), DV = (int)(D / 16);
    const int kind = NH * 100 + DV;
    if (NH > 16 || DV > 16) return 2;
    int paired = 0;
    switch (kind) {
#define PAIRED_OF(nh, dv) case nh * 100 + dv: paired = 1; break;
        PAIRED_SHAPES(PAIRED_OF)
    }
    /* units: a pair of consecutive query tokens of one row (same cache row and prefix) where the shape
       is paired, else one token */
    int64_t *unit = malloc(sizeof(int64_t) * (T > 0 ? T : 1));
    if (!unit) return 1;
    int64_t U = 0;
    for (int64_t i = 0; i < T; ) {
        unit[U++] = i;
        i += (paired && i + 1 < T && rows[i + 1] == rows[i] && prefix[i + 1] == prefix[i]) ? 2 : 1;
    }
    int err = 0;
    #pragma omp parallel for num_threads(nthreads) schedule(static) reduction(|: err)
    for (int64_t task = 0; task < U * G; task++) {
        const int64_t g = task / U, u = task % U;  /* a thread walks the units of one key/value head: its keys stay in cache */
        const int64_t i = unit[u], n = (u + 1 < U ? unit[u + 1] : T) - i;
        const float *qi = q + (i * H + g * NH) * D;
        float *oi = out + (i * H + g * NH) * D;
        const float *K = kb + rows[i] * row_stride + g * head_stride;
        const float *V = vb + rows[i] * row_stride + g * head_stride;
        const uint8_t *vi = vis + i * W;
        const int64_t P = prefix[i];
        switch (kind * 2 + (int)n) {  /* n == 2 only for a paired shape */
#define ONE_OF(nh, dv) case (nh * 100 + dv) * 2 + 1: err |= several(qi, oi, H * D, K, V, P, vi, W, scale, nh, dv, 1); break;
#define TWO_OF(nh, dv) case (nh * 100 + dv) * 2 + 2: err |= several(qi, oi, H * D, K, V, P, vi, W, scale, nh, dv, 2); break;
            SHAPES(ONE_OF)
            PAIRED_SHAPES(TWO_OF)
            default: err |= several(qi, oi, H * D, K, V, P, vi, W, scale, NH, DV, 1);
        }
    }
    free(unit);
    return err;
}
