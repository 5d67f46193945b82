/* The vector types and helpers every kernel shares: 16-float vectors (GCC vector extensions, compiled
   with -march=native: AVX-512, AVX2 or NEON underneath), unaligned loads and stores, a broadcast, a sum
   of the lanes in a fixed order (so a kernel's sums do not depend on how the compiler schedules them),
   a test of whether any lane of a compare is set, exp; and the widest float vector of the target, for
   the peak loop. Everything here is static inline: each kernel file compiles what it uses. */
#ifndef TR_VEC_H
#define TR_VEC_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat(float x) { return (v16){0} + x; }

/* sum of the 16 lanes, halves folded in a fixed order */
static inline float hsum(v16 a) {
    a += __builtin_shuffle(a, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    a += __builtin_shuffle(a, (i16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    a += __builtin_shuffle(a, (i16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    a += __builtin_shuffle(a, (i16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return a[0];
}

/* whether any lane of m is set, halves folded as in hsum (a loop over the lanes compiles to a chain
   of scalar extracts) */
static inline int any_lane(i16 m) {
    m |= __builtin_shuffle(m, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    m |= __builtin_shuffle(m, (i16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    m |= __builtin_shuffle(m, (i16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    m |= __builtin_shuffle(m, (i16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return m[0] != 0;
}

/* exp(x) for x in [-87, 88] (Cephes expf, about 1 ulp); the callers clamp and mask */
static inline v16 exp_in_range(v16 x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    v16 t = x * 1.44269504088896341f + magic;
    v16 n = t - magic;
    v16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    i16 e = ((i16)t - (i16)splat(magic) + 127) << 23;
    return p * (v16)e;
}

/* the widest float vector the target has (the fp32 peak loop, fma_peak.c: its accumulators must stay
   in registers, 16 of them on AVX2 and SSE, where a 64-byte vector takes two) */
#if defined(__AVX512F__)
#define NATIVE_LANES 16
#elif defined(__AVX__)
#define NATIVE_LANES 8
#else
#define NATIVE_LANES 4
#endif
typedef float vnat __attribute__((vector_size(NATIVE_LANES * 4)));

#endif
