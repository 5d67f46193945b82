/* A loop of independent fused multiply-adds at this CPU's float32 peak (bench/roofline.py times it). */
#ifndef TR_FMA_PEAK_H
#define TR_FMA_PEAK_H

#include <stdint.h>

/* accumulators per thread: enough to hide a multiply-add's latency on 1-2 units, and with w and x 14
   registers, within the 16 of AVX2 (bench/roofline.py's CHAINS holds the same number) */
#define FMA_CHAINS 12

/* FMA_CHAINS chains of `iters` multiply-adds of NATIVE_LANES floats on each of nthreads threads; the
   lanes' sum to *out. Returns the lanes (0: no threads, no iterations). */
int tr_fma_peak(int64_t iters, int nthreads, float *out);

#endif
