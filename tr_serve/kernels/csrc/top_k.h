/* The top-k token ids of every row of a step's logits, and with them the argmax, in one pass
   (runner/top_k.py checks the arguments). */
#ifndef TR_TOP_K_H
#define TR_TOP_K_H

#include <stdint.h>

/* the largest k a call takes (runner/top_k.py's MAX_K holds the same number) */
#define TOP_K_MAX 64

/* x [n][V], V a multiple of 16, 1 <= k <= TOP_K_MAX: out[r][0..k) the indices of row r's k largest
   values, largest first; flags[r] = 1 when the row holds a NaN or fewer than k values above -inf */
int tr_top_k(const float *x, int64_t ldx, int64_t n, int64_t V, int64_t k, int64_t *out, int32_t *flags,
             int nthreads);

#endif
