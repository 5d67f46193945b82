/* The panel GEMM (panel_gemm.h; why and how: runner/panel_gemm.py). */
#include <omp.h>

#include "panel_gemm.h"
#include "vec.h"

/* the address to prefetch for line l of the first of NP consecutive panels at p (add j * K * 16 for
   panel j): past a panel's end (l >= K), line l - K of the next group's panels, so that all NP of
   their streams are under way when the group starts. Before, the lines past a panel's end were the
   next panel's, which this group streams already: a new group started with all but one of its
   streams cold (a prefetch never faults, so lines past the weights are harmless). Measured on 604
   MB of K = 576 panels (past this machine's L3), 2 threads, old and new alternated, best of 9 in
   each of 3 runs, with the split path's sub-blocks and distance below: 8 rows 19.4 -> 18.6-19.1
   ms, 16 rows 22.0-22.4 -> 20.1-20.2, 24 rows 27.6-28.0 -> 23.5-23.9 */
static inline const float *pf_line(const float *p, int64_t K, int NP, int64_t l) {
    return l < K ? p + 16 * l : p + (int64_t)NP * K * 16 + 16 * (l - K);
}

#define KB 128   /* k per accumulation block */
#define PF_LINES 64  /* prefetch distance of the groups below, in k (lines of a panel) */

/* acc[NP][MM] += the products of k in [k0, k1) of NP consecutive panels at p with MM rows of xt (x
   transposed, [K][16]), by fused multiply-adds in k order; at each k, PF_AT (an expression of k) is
   prefetched for the first panel and the same offset for the others, into L2 where l2 (a parameter of
   every kernel below) is set, else into L1 */
#define PRODUCTS(MM, NP, PF_AT)                                                                      \
    for (int64_t k = k0; k < k1; k++) {                                                              \
        const float *xk = xt + k * 16, *pf = (PF_AT);                                                \
        for (int j = 0; j < NP; j++) {                                                               \
            const float *pj = p + j * K * 16 + k * 16;                                               \
            if (l2) __builtin_prefetch(pf + j * K * 16, 0, 2);                                       \
            else __builtin_prefetch(pf + j * K * 16, 0, 3);                                          \
            v16 w;                                                                                   \
            memcpy(&w, pj, sizeof w);                                                                \
            for (int m = 0; m < MM; m++) acc[j][m] += w * xk[m];                                     \
        }                                                                                            \
    }
/* acc[NP][MM]: a block's products, summed from zero */
#define BLOCK_PRODUCTS(MM, NP)                                                                       \
    v16 acc[NP][MM];                                                                                 \
    for (int j = 0; j < NP; j++) for (int m = 0; m < MM; m++) acc[j][m] = (v16){0};                  \
    PRODUCTS(MM, NP, pf_line(p, K, NP, k + PF_LINES))
/* y[m][panel j] += acc[j][m]: a block's products added to the running totals kept in y */
#define ADD_BLOCK_TO_Y(MM, NP)                                                                       \
    for (int j = 0; j < NP; j++)                                                                     \
        for (int m = 0; m < MM; m++) {                                                               \
            v16 t;                                                                                   \
            memcpy(&t, y + m * ldy + j * 16, sizeof t);                                              \
            t += acc[j][m];                                                                          \
            memcpy(y + m * ldy + j * 16, &t, sizeof t);                                              \
        }

/* NP consecutive panels (NP*16 outputs) for MM rows. IN_Y: the running totals kept in y instead of
   registers (the same sums in the same order, so the same results), which frees registers for
   more panels at once */
#define DEFINE_GROUP_AS(NAME, MM, NP, IN_Y)                                                          \
static void NAME(const float *restrict xt, const float *restrict p, int64_t K,                       \
                 float *restrict y, int64_t ldy, int l2) {                                           \
    v16 tot[NP][MM];                                                                                 \
    for (int j = 0; j < NP; j++)                                                                     \
        for (int m = 0; m < MM; m++) {                                                               \
            if (IN_Y) memset(y + m * ldy + j * 16, 0, sizeof(v16));                                  \
            else tot[j][m] = (v16){0};                                                               \
        }                                                                                            \
    for (int64_t k0 = 0; k0 < K; k0 += KB) {                                                         \
        int64_t k1 = k0 + KB < K ? k0 + KB : K;                                                      \
        BLOCK_PRODUCTS(MM, NP)                                                                       \
        if (IN_Y) { ADD_BLOCK_TO_Y(MM, NP) }                                                         \
        else for (int j = 0; j < NP; j++) for (int m = 0; m < MM; m++) tot[j][m] += acc[j][m];       \
    }                                                                                                \
    if (!IN_Y)                                                                                       \
        for (int j = 0; j < NP; j++)                                                                 \
            for (int m = 0; m < MM; m++) memcpy(y + m * ldy + j * 16, &tot[j][m], sizeof(v16));      \
}
#define DEFINE_GROUP(MM, NP) DEFINE_GROUP_AS(group_##MM##_##NP, MM, NP, 0)
#define DEFINE_GROUP_Y(MM, NP) DEFINE_GROUP_AS(groupy_##MM##_##NP, MM, NP, 1)

DEFINE_GROUP(1, 4) DEFINE_GROUP(2, 4) DEFINE_GROUP(3, 4) DEFINE_GROUP(4, 4) DEFINE_GROUP(1, 2) DEFINE_GROUP(2, 2) DEFINE_GROUP(3, 2) DEFINE_GROUP(4, 2)
DEFINE_GROUP(5, 2) DEFINE_GROUP(6, 2)
DEFINE_GROUP(1, 1) DEFINE_GROUP(2, 1) DEFINE_GROUP(3, 1) DEFINE_GROUP(4, 1)
DEFINE_GROUP(5, 1) DEFINE_GROUP(6, 1)
DEFINE_GROUP(9, 1)

DEFINE_GROUP_Y(5, 4) DEFINE_GROUP_Y(6, 4)
DEFINE_GROUP_Y(9, 3)
DEFINE_GROUP_Y(9, 2)

/* Rows in blocks of up to 8 (shared out evenly: see tr_panel_gemm) over NP panels at a time (10-12
   rows and 17 or more), one sub-block of SPLIT_K k at a time: the sub-block's weights (NP x SPLIT_K x
   64 bytes) come from memory for the first block and from the L1 cache for the next, so 3 weight
   streams are in flight per thread instead of 1, with up to 24 totals in registers. The passes over
   the L1 copy are short (SPLIT_K k), so the weight stream, kept going by prefetches SPLIT_PF_LINES k
   ahead, never waits long for them. Between sub-blocks a row block's partial sums wait in a scratch
   slot (s[j * R + m]; a float stored and read back is the same float), and the last sub-block of a
   128-k block adds them to the row's total in y (zeroed first): each block's products are still summed
   from zero in k order, then added in block order, the same sums in the same order as the groups
   above, so the same results. Calls of more than SPLIT_K_ROWS rows, whose passes are bound by the
   multiply-adds, take whole 128-k blocks (sub-blocks: 1-2% slower at 48-64 rows).
   Prefetching: every pass used to prefetch its own k + 16, so after the first pass over a sub-block
   the others only asked for lines already asked for, and memory idled through them. Now the passes
   share the job (pass r prefetches the r-th 1/passes of the lines SPLIT_PF_LINES k ahead of the
   sub-block, at 1/passes line per k), so the stream never pauses. SmolLM2-135M's linears and LM
   head, 2 threads, medians of 9: 12 rows 21.8 -> 21.1 ms, 16 rows 23.9 -> 22.6, 24 rows 32.2 ->
   29.1, 32 rows 39.1 -> 34.6; 1-9 and 48-64 rows unchanged. */
#define SPLIT_ROWS 8   /* rows per block: divides the 16 rows of a chunk of xt */
#define SPLIT_PANELS 3
/* k per sub-block up to SPLIT_K_ROWS rows (more rows: whole blocks); divides KB. With the next group's
   streams prefetched (pf_line), longer sub-blocks pay: 604 MB of K = 576 panels, 2 threads, best of 9
   x 3 alternated runs, 32 k -> 64 k: 14 rows 19.2-19.7 -> 18.4-19.0 ms, 16 rows 19.8-20.2 -> 18.9-19.7,
   20 rows 23.5-23.7 -> 20.6-21.1, 24 rows 26.4-26.9 -> 23.1-23.4; 10-12 rows level; 32 rows in
   whole blocks 27.6-28.1 (64 k: 28.4-28.5, 32 k: 30.2-30.6) */
#define SPLIT_K 64
#define SPLIT_K_ROWS 24
#define SPLIT_PF_LINES 128  /* prefetch distance from a sub-block's first k, in k (lines of a panel) */
#define SPLIT_SLOT (SPLIT_ROWS * SPLIT_PANELS)  /* scratch per row block, in vectors */
/* 7-8 and 13-16 rows: blocks of NARROW_ROWS rows over NARROW_PANELS panels (each sub-block's weights
   from memory for the first block, from L1 for the others). The weight stream's speed follows how many
   panels are read at once: 8 rows in registers fit 3 panels, whose 3 streams left the stream ~10%
   below one row's 4. Measured standalone, 2 threads, alternated runs: on 604 MB of K = 576 panels
   (best of 15, 3 runs) 8 rows 18.6-19.6 ms in groups of 3 panels -> 17.9-18.2 in blocks of 4 rows over
   6 panels, 7 rows 18.3-19.6 -> 17.7-18.6 (1 row 16.6-17.0); on SmolLM2-135M's 120 layer GEMMs (best of
   25, 2-4 runs) 8 rows 13.25-13.69 -> 13.0-13.24 ms, 14 rows 14.15-14.40 -> 13.58-13.76 (against blocks
   of 8 over 3 panels), 16 rows 14.62-14.98 -> 14.27-14.50. 5-6 rows (4 panels in registers), 9 rows, 12
   rows (13.5-13.7 -> 14.0-14.3) and 24 rows (18.1-18.4 -> 19.5-19.9) were slower this way. */
#define NARROW_ROWS 4
#define NARROW_PANELS 6
#define NARROW_MAX_ROWS 16
/* whether 13-16 rows take the narrow blocks too (tr_panel_gemm_set_wide_narrow): where they are faster
   depends on the CPU, so the kernel plan measures both (cpu_kernels.py). Both give the same sums in the
   same order. On this 2-core AMD EPYC Zen 4 (one 512-bit multiply-add per cycle per core), SmolLM2-135M's
   linears and LM head, 2 threads, medians of 9: 13 rows 25.6-27.5 -> 21.4-23.6 ms, 16 rows 27.9-29.9 ->
   24.6-26.4 in blocks of 8 over 3 panels, while the CPU the narrow blocks were measured on (two per
   cycle) ran 16 rows 2.4% faster in them */
static int wide_narrow = 1;
void tr_panel_gemm_set_wide_narrow(int on) { wide_narrow = on != 0; }
/* per row count, whether the weight stream is prefetched into L2 (1) instead of L1 (0, the default);
   set by the kernel plan (tr_panel_gemm_set_prefetch_l2), which measures both: which is faster depends
   on the CPU. Same results either way. On this 2-core AMD EPYC Zen 4, SmolLM2-135M's linears and LM head,
   2 threads, medians of 9: 1 row 15.4-15.7 -> 13.5 ms, 4 rows 16.2-16.7 -> 14.0, 8 rows 19.4-19.6 ->
   16.5, 12 rows 22.9-23.5 -> 22.5, 16 rows level, 24-48 rows up to 8% slower (a software prefetch into
   L2 holds no L1 miss buffer, so more of the stream can be in flight while few rows compute) */
static unsigned char prefetch_l2[PREFETCH_L2_MAX_ROWS + 1];
void tr_panel_gemm_set_prefetch_l2(int64_t rows, int on) {
    if (rows >= 1 && rows <= PREFETCH_L2_MAX_ROWS) prefetch_l2[rows] = on != 0;
}
static inline int narrow(int64_t M) {
    return (M >= 7 && M <= 8) || (wide_narrow && M >= 13 && M <= NARROW_MAX_ROWS);
}
#if NARROW_ROWS * NARROW_PANELS != SPLIT_SLOT
#error "both row-block shapes share the scratch slot's size"
#endif
/* R rows per block (the scratch slot's layout: s[j * R + m]) */
#define DEFINE_SPLIT(R, MM, NP)                                                                      \
static void split##R##_##MM##_##NP(const float *restrict xt, const float *restrict p, int64_t K,     \
                              float *restrict y, int64_t ldy, v16 *restrict s, int64_t k0,          \
                              int64_t k1, int first, int last, const float *pf0, int64_t pf_step,   \
                              int l2) {                                                             \
    v16 acc[NP][MM];                                                                                 \
    for (int j = 0; j < NP; j++)                                                                     \
        for (int m = 0; m < MM; m++) acc[j][m] = first ? (v16){0} : s[j * R + m];                    \
    PRODUCTS(MM, NP, pf0 + (((k - k0) * pf_step) >> 16))                                            \
    if (last) { ADD_BLOCK_TO_Y(MM, NP) }                                                             \
    else for (int j = 0; j < NP; j++) for (int m = 0; m < MM; m++) s[j * R + m] = acc[j][m];         \
}
#define DEFINE_SPLITS(NP) DEFINE_SPLIT(8, 1, NP) DEFINE_SPLIT(8, 2, NP) DEFINE_SPLIT(8, 3, NP) DEFINE_SPLIT(8, 4, NP) \
                          DEFINE_SPLIT(8, 5, NP) DEFINE_SPLIT(8, 6, NP) DEFINE_SPLIT(8, 7, NP) DEFINE_SPLIT(8, 8, NP)
#define DEFINE_NARROW(NP) DEFINE_SPLIT(4, 1, NP) DEFINE_SPLIT(4, 2, NP) DEFINE_SPLIT(4, 3, NP) DEFINE_SPLIT(4, 4, NP)
DEFINE_SPLITS(1) DEFINE_SPLITS(2) DEFINE_SPLITS(3)
DEFINE_NARROW(1) DEFINE_NARROW(2) DEFINE_NARROW(3) DEFINE_NARROW(4) DEFINE_NARROW(5) DEFINE_NARROW(6)

typedef void (*split_fn)(const float *, const float *, int64_t, float *, int64_t, v16 *, int64_t, int64_t, int, int,
                         const float *, int64_t, int);
/* [panels][rows of the block] */
static const split_fn SPLITS[SPLIT_PANELS + 1][SPLIT_ROWS + 1] = {
    {0},
    {0, split8_1_1, split8_2_1, split8_3_1, split8_4_1, split8_5_1, split8_6_1, split8_7_1, split8_8_1},
    {0, split8_1_2, split8_2_2, split8_3_2, split8_4_2, split8_5_2, split8_6_2, split8_7_2, split8_8_2},
    {0, split8_1_3, split8_2_3, split8_3_3, split8_4_3, split8_5_3, split8_6_3, split8_7_3, split8_8_3}};
static const split_fn NARROW[NARROW_PANELS + 1][NARROW_ROWS + 1] = {
    {0},
    {0, split4_1_1, split4_2_1, split4_3_1, split4_4_1}, {0, split4_1_2, split4_2_2, split4_3_2, split4_4_2},
    {0, split4_1_3, split4_2_3, split4_3_3, split4_4_3}, {0, split4_1_4, split4_2_4, split4_3_4, split4_4_4},
    {0, split4_1_5, split4_2_5, split4_3_5, split4_4_5}, {0, split4_1_6, split4_2_6, split4_3_6, split4_4_6}};

/* NP panels at p for M rows of xt (chunks of CR rows, [chunks][K][16]; a block never straddles two) in
   blocks of R rows (fns[mm]: the kernel of a block of mm rows over NP panels); s: ceil(M / R) slots */
static void split_rows(const float *xt, const float *p, int64_t K, float *y, int64_t ldy, int64_t M, int NP,
                       v16 *s, int64_t R, const split_fn *fns, int l2, int64_t CR) {
    int64_t sub = M <= SPLIT_K_ROWS ? SPLIT_K : KB;
    /* the row blocks' passes over a sub-block share the prefetches of its lines SPLIT_PF_LINES ahead,
       1/passes line per k each: the stream keeps going through the passes over the L1 copy too, where
       every pass prefetching the same lines had left memory idle after the first. pf_step: floats per
       k in 16.16 fixed point, rounded up, so the passes' shares cover every line: as the integer
       16 / passes, 3 passes (17-24 rows) left 4 lines of each panel's 64 per sub-block unprefetched
       (SmolLM2-135M's linears and LM head, 2 threads, medians of 9, alternated: 17 rows 28.3 -> 27.8
       ms, 20 rows 31.3 -> 30.3; 24 rows and 2 or 4 passes level) */
    const int64_t passes = (M + R - 1) / R, pf_step = (16 * 65536 + passes - 1) / passes;
    for (int64_t m = 0; m < M; m++) memset(y + m * ldy, 0, sizeof(float) * 16 * NP);
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        int64_t k1 = k0 + KB < K ? k0 + KB : K;
        for (int64_t s0 = k0; s0 < k1; s0 += sub) {
            int64_t s1 = s0 + sub < k1 ? s0 + sub : k1;
            for (int64_t m0 = 0; m0 < M; m0 += R) {
                int64_t mm = M - m0 < R ? M - m0 : R;
                fns[mm](xt + (m0 / CR) * K * 16 + m0 % CR, p, K, y + m0 * ldy, ldy, s + (m0 / R) * SPLIT_SLOT, s0, s1,
                        s0 == k0, s1 == k1, pf_line(p, K, NP, s0 + SPLIT_PF_LINES + (m0 / R) * (s1 - s0) / passes),
                        pf_step, l2);
            }
        }
    }
}

#define SPLIT_MAX_ROWS 128  /* rows per split_rows call: 24 KB of scratch */
#if NARROW_MAX_ROWS / NARROW_ROWS > SPLIT_MAX_ROWS / SPLIT_ROWS
#error "the scratch of row_blocks holds SPLIT_MAX_ROWS / SPLIT_ROWS row blocks"
#endif
/* NP panels at p for all M rows of xt in blocks of R rows (fns[mm]: the kernel of a block of mm rows
   over NP panels; R is SPLIT_ROWS, or NARROW_ROWS for at most NARROW_MAX_ROWS rows), 128 rows at a
   time. The scratch is on the thread's stack: in one heap buffer beside xt_buf (both page-aligned),
   24-64 rows ran 15-20% slower (35.9 -> 41.8 ms at 24 rows, measured when every sub-block's sums went
   through it), as if its stores and xt's loads collided at the same offsets in 4 KB pages. */
static void row_blocks(const float *xt, const float *p, int64_t K, float *y, int64_t ldy, int64_t M, int NP,
                       int64_t R, const split_fn *fns, int l2, int64_t CR) {
    v16 s[SPLIT_MAX_ROWS / SPLIT_ROWS * SPLIT_SLOT];
    for (int64_t r0 = 0; r0 < M; r0 += SPLIT_MAX_ROWS)
        split_rows(xt + (r0 / CR) * K * 16, p, K, y + r0 * ldy, ldy,
                   M - r0 < SPLIT_MAX_ROWS ? M - r0 : SPLIT_MAX_ROWS, NP, s, R, fns, l2, CR);
}

typedef void (*group_fn)(const float *, const float *, int64_t, float *, int64_t, int);
static const group_fn QUADS_Y[7] = {0, 0, 0, 0, 0, groupy_5_4, groupy_6_4};
static const group_fn TRIPLES_Y[10] = {0, 0, 0, 0, 0, 0, 0, 0, 0, groupy_9_3};
static const group_fn PAIRS_Y[10] = {0, 0, 0, 0, 0, 0, 0, 0, 0, groupy_9_2};

static const group_fn QUADS[5] = {0, group_1_4, group_2_4, group_3_4, group_4_4};
static const group_fn PAIRS[7] = {0, group_1_2, group_2_2, group_3_2, group_4_2, group_5_2, group_6_2};
static const group_fn SINGLES[10] = {0, group_1_1, group_2_1, group_3_1, group_4_1, group_5_1, group_6_1, 0, 0,
                                     group_9_1};  /* 7-8 rows: row_blocks */

/* xt's lines for k in [ka, kb): x's rows [M][K] (row stride ldx) transposed, chunk by chunk of CR rows
   (16, or a balanced row block's size: see tr_panel_gemm), each 64-byte line (one k of a chunk)
   written whole at once; columns past a chunk's last row are never read. Why this order and split: row
   by row, every row wrote one float into each of K lines (a K of 1536 is 96 KB of lines, past L1), and
   one thread did it while the other waited. Measured on a 2-panel call, 2 threads: K = 1536, 8 rows 39
   -> 22 us, 16 rows 57 -> 25 us; SmolLM2-135M's linears and LM head, medians of 9: 1 row 19.4 -> 18.9
   ms, 8 rows 21.3 -> 20.5, 16 rows 26.1 -> 24.9. */
static void transpose_x(const float *x, int64_t ldx, float *xt, int64_t M, int64_t K, int64_t ka, int64_t kb,
                        int64_t CR) {
    for (int64_t m0 = 0; m0 < M; m0 += CR) {
        int64_t mm = M - m0 < CR ? M - m0 : CR;
        float *dst = xt + (m0 / CR) * K * 16;
        const float *src = x + m0 * ldx;
        for (int64_t k = ka; k < kb; k++)
            for (int64_t m = 0; m < mm; m++) dst[k * 16 + m] = src[m * ldx + k];
    }
}

static __thread float *xt_buf;  /* x transposed per chunk of 16 rows, [chunks][K][16]; grows, never shrinks */
static __thread int64_t xt_cap;

/* y[M][ldy] = x[M][K] (row stride ldx) . panels P[NB][K][16]; ldy >= NB*16; returns 0 on success, 1
   out of memory, 2 for sizes it does not take (no rows: the group tables have no kernel for 0).
   One parallel region: x is first transposed into chunks of 16 rows (each thread a share of k, then a
   barrier), then each thread takes an equal run of panels. */
int tr_panel_gemm(const float *x, int64_t ldx, const float *P, float *y, int64_t ldy,
                  int64_t M, int64_t K, int64_t NB, int nthreads) {
    if (M < 1 || K < 1 || NB < 1 || ldx < K || ldy < NB * 16 || nthreads < 1) return 2;
    /* the split path's row blocks (10-12 rows and 17-128; 13-16 where not narrow): as many as blocks of
       SPLIT_ROWS need, the rows shared out evenly (17 rows: 6 + 6 + 5, not 8 + 8 + 1). A block of 1-2
       rows has too few chains of multiply-adds to hide their latency, and its pass over the sub-block
       costs nearly what a full one does. Above 16 rows, xt is laid out in chunks of one block each, so
       that no block straddles a line of 16 rows. Each row's sums are the same, in the same order, in
       any block. SmolLM2-135M's linears and LM head, 2 threads, medians of 9, alternated: 10 rows
       19.9 -> 19.1 ms, 11: 20.0 -> 18.9, 12: 20.8 -> 19.4, 17: 28.2 -> 25.7, 18: 28.8 -> 27.0, 33:
       48.8 -> 47.5; 13-16, 20 and 24 rows level or within 1% */
    const int64_t blocks = (M + SPLIT_ROWS - 1) / SPLIT_ROWS;
    const int balanced = M > 9 && M <= SPLIT_MAX_ROWS;
    const int64_t RB = balanced ? (M + blocks - 1) / blocks : SPLIT_ROWS, CR = M > 16 && balanced ? RB : 16;
    int64_t chunks = (M + CR - 1) / CR;
    if (chunks * K * 16 > xt_cap) {
        free(xt_buf);
        xt_buf = aligned_alloc(64, (size_t)(((chunks * K * 16 * sizeof(float)) + 63) / 64 * 64));
        xt_cap = xt_buf ? chunks * K * 16 : 0;
        if (!xt_buf) return 1;
    }
    float *xt = xt_buf;
    const int l2 = M <= PREFETCH_L2_MAX_ROWS && prefetch_l2[M];
    #pragma omp parallel num_threads(nthreads)
    {
        int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        transpose_x(x, ldx, xt, M, K, K * t / nt, K * (t + 1) / nt, CR);  /* each thread a share of k */
        #pragma omp barrier
        int64_t b0 = NB * t / nt, b1 = NB * (t + 1) / nt, b = b0;  /* each thread an equal run of panels */
        if (M <= 9 && !narrow(M)) {
            /* NP panels at a time (NP weight streams in flight, NP chains of multiply-adds
               per row), as many as the registers hold: 4 up to 6 rows, 3 for 9 (measured,
               SmolLM2-135M's linears and LM head, 2 threads, medians of 13: 5 rows 30.5 -> 29.9 ms,
               6 rows 30.6 -> 30.2 with 4 panels instead of 3; 9 rows 35.4 -> 33.0 with 3 instead of 2;
               7 rows with 4 were no faster: their totals and weights fill the registers; 7-8 rows
               now take blocks of 4 rows below). A run's last few panels go in smaller groups. */
            group_fn G = M <= 4 ? QUADS[M] : M <= 6 ? QUADS_Y[M] : TRIPLES_Y[M];
            int64_t NP = M <= 6 ? 4 : 3;
            for (; b + NP <= b1; b += NP) G(xt, P + b * K * 16, K, y + b * 16, ldy, l2);
            for (; b + 2 <= b1; b += 2)  /* NP is 3 or 4 here: the tail's pairs, then singles */
                (M <= 6 ? PAIRS[M] : PAIRS_Y[M])(xt, P + b * K * 16, K, y + b * 16, ldy, l2);
            for (; b < b1; b++) SINGLES[M](xt, P + b * K * 16, K, y + b * 16, ldy, l2);
        } else {
            /* rows in blocks (row_blocks), per sub-block of SPLIT_K k: 7-8 and 13-16 rows in blocks of 4
               over 6 panels at a time (narrow: more weight streams than the registers hold for all
               rows), 10-12 rows and 17 or more in blocks of up to 8 over 3 panels; a run's last panels
               together. Why these shapes: docs/kernels.md, "Decisions" (9 rows were no faster this
               way) */
            const int four = narrow(M), group = four ? NARROW_PANELS : SPLIT_PANELS;
            for (; b < b1; b += group) {
                const int np = b1 - b < group ? (int)(b1 - b) : group;
                row_blocks(xt, P + b * K * 16, K, y + b * 16, ldy, M, np, four ? NARROW_ROWS : RB,
                           four ? NARROW[np] : SPLITS[np], l2, CR);
            }
        }
    }
    return 0;
}
