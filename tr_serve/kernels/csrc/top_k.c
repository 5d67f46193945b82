/* The top-k kernel (top_k.h; why and how: runner/top_k.py). */
#include "top_k.h"
#include "vec.h"

/* x [n][V] (row stride ldx), V a multiple of 16, 1 <= k <= TOP_K_MAX: out[r][0..k) the indices of row r's
   k largest values, largest first, equal values in index order; flags[r] = 1 when the row holds a
   NaN or fewer than k values above -inf. */
int tr_top_k(const float *x, int64_t ldx, int64_t n, int64_t V, int64_t k, int64_t *out, int32_t *flags,
             int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if(n > 1)
    for (int64_t r = 0; r < n; r++) {
        const float *row = x + r * ldx;
        float val[TOP_K_MAX];
        int64_t idx[TOP_K_MAX];
        int64_t have = 0;
        float thr = -INFINITY;  /* the k-th largest so far; -inf until k values are held */
        i16 nan = (i16){0};
        for (int64_t i = 0; i < V; i += 16) {
            if (i % 64 == 0 && i + 64 <= V) {  /* 4 blocks skipped together when none beats thr */
                v16 a = load16(row + i), b = load16(row + i + 16);
                v16 c = load16(row + i + 32), d = load16(row + i + 48);
                nan |= (a != a) | (b != b) | (c != c) | (d != d);
                if (!any_lane((a > thr) | (b > thr) | (c > thr) | (d > thr))) {
                    i += 48;
                    continue;
                }
            }
            v16 v = load16(row + i);
            nan |= (v != v);
            if (!any_lane(v > thr)) continue;
            for (int j = 0; j < 16; j++) {
                float f = row[i + j];
                if (!(f > thr)) continue;
                int64_t p = have < k ? have : k - 1;  /* after every held value >= f */
                while (p > 0 && val[p - 1] < f) { val[p] = val[p - 1]; idx[p] = idx[p - 1]; p--; }
                val[p] = f;
                idx[p] = i + j;
                if (have < k) have++;
                if (have == k) thr = val[k - 1];
            }
        }
        int32_t bad = 0;  /* once per row (any_lane here measured ~10% slower at 18 rows, in cache) */
        for (int j = 0; j < 16; j++) bad |= nan[j];
        flags[r] = (bad || have < k) ? 1 : 0;
        for (int64_t j = 0; j < k; j++) out[r * k + j] = j < have ? idx[j] : 0;
    }
    return 0;
}
