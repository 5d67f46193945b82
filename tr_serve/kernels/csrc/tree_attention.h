/* Attention of a verify step's packed query tokens over the KV cache, each token over its row's prefix
   and the step's new slots it sees (runner/tree_attention.py checks the arguments). */
#ifndef TR_TREE_ATTENTION_H
#define TR_TREE_ATTENTION_H

#include <stdint.h>

/* q, out [T][H][D]; K/V of cache row r, key/value head g at kb/vb + r * row_stride + g * head_stride:
   0, 1 out of memory, 2 for shapes it does not take, 3 for a row or slots outside the cache */
int tr_tree_attention(const float *q, float *out, const float *kb, const float *vb, int64_t row_stride,
                      int64_t head_stride, int64_t R, int64_t L, const int64_t *rows, const int64_t *prefix,
                      const uint8_t *vis, int64_t W, int64_t T, int64_t H, int64_t G, int64_t D, float scale,
                      int nthreads);

#endif
