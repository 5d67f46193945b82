/* The fp32 peak loop (fma_peak.h; why: bench/roofline.py). Its vector is vec.h's vnat, the widest the
   target has, so that FMA_CHAINS accumulators stay in registers (16 of them on AVX2 and SSE: a 64-byte
   vector there takes two, and 24 spilled to the stack). */
#include <omp.h>

#include "fma_peak.h"
#include "vec.h"

/* FMA_CHAINS independent chains of ITERS fused multiply-adds of NATIVE_LANES floats per thread; the sum
   of every lane goes to out so that nothing is optimised away. Returns NATIVE_LANES (0: no threads, no
   iterations). */
int tr_fma_peak(int64_t iters, int nthreads, float *out) {
    if (iters < 1 || nthreads < 1) return 0;
    float total = 0.0f;
    #pragma omp parallel num_threads(nthreads) reduction(+:total)
    {
        /* w and x depend on run-time values, so the compiler can fold nothing out of the loop */
        const vnat w = (vnat){0} + (0.999999f + 1e-9f * (float)nthreads);
        const float x = 1e-7f * (float)(omp_get_thread_num() + 1);
        vnat acc[FMA_CHAINS];
        for (int j = 0; j < FMA_CHAINS; j++) acc[j] = (vnat){0} + (float)j;
        for (int64_t i = 0; i < iters; i++)
            for (int j = 0; j < FMA_CHAINS; j++) acc[j] = acc[j] * w + x;
        for (int j = 0; j < FMA_CHAINS; j++)
            for (int l = 0; l < NATIVE_LANES; l++) total += acc[j][l];
    }
    *out = total;
    return NATIVE_LANES;
}
