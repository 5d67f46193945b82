/* The small-M fp32 GEMM y = x . W^T over weights packed as panels of 16 outputs (runner/panel_gemm.py
   packs them and checks every call's arguments before it reaches C). */
#ifndef TR_PANEL_GEMM_H
#define TR_PANEL_GEMM_H

#include <stdint.h>

/* calls of more rows always prefetch the weights into L1 (runner/panel_gemm.py holds the same number) */
#define PREFETCH_L2_MAX_ROWS 64

/* y[M][ldy] = x[M][K] (row stride ldx) . panels P[NB][K][16]: 0, 1 out of memory, 2 for sizes it does
   not take */
int tr_panel_gemm(const float *x, int64_t ldx, const float *P, float *y, int64_t ldy, int64_t M, int64_t K,
                  int64_t NB, int nthreads);

/* whether calls of 13-16 rows take blocks of 4 rows over 6 panels (on, the default) or of 8 over 3 */
void tr_panel_gemm_set_wide_narrow(int on);

/* whether calls of exactly `rows` rows (1 to PREFETCH_L2_MAX_ROWS) prefetch the weights into L2 */
void tr_panel_gemm_set_prefetch_l2(int64_t rows, int on);

#endif
