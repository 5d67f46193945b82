/* A verify step's decoder layers in one call: the Python loop of runner/llama_body.py in C, calling the
   panel GEMM, layer ops and tree attention in the same order on the same buffers (runner/layer_driver.py
   checks the arguments). */
#ifndef TR_LAYER_DRIVER_H
#define TR_LAYER_DRIVER_H

#include <stdint.h>

/* dims: t tokens, D hidden, H heads, G key/value heads, d head size, I intermediate, L cache slots per
   row, R cache rows; w: 8 pointers per layer (see layer_driver.c); h [t, D] updated in place, out [t, D]
   the final norm's output; 0, or a kernel's nonzero code */
int tr_decoder_layers(const int64_t *dims, float *const *w, int64_t nlayers, float *h, const float *cos,
                      const float *sin, const int64_t *rows, const int64_t *slots, const int64_t *qrows,
                      const int64_t *qprefix, const uint8_t *vis, int64_t W, const float *final_norm, float *out,
                      float *scratch, float eps, float scale, int nthreads);

#endif
