/* Kernels over weights packed in panels (engine/cpu_kernels.py's panel_pack): the routed experts' layout where the
   compiled one-call path runs every step.

   A weight W [N, K] (N a multiple of VW) is stored as panels of PANEL output rows (the last one narrower, pw = the
   rows left): panel p holds rows [n0, n0 + pw) as K rows of pw floats, element (n, k) at n0 K + k pw + (n - n0).
   Each panel is one contiguous stream of memory, read front to back.

   panel_gemv multiplies a few rows by it with the weights as vectors and the inputs broadcast: each k loads the
   panel's pw floats once (NV vectors) and multiplies them into the sums of every row, so no lane sums are left for
   the end and a weight line is read once for up to six rows. Against gemv over row-major weights (a lane sum per
   output, four streams a block), measured on cold experts (AMD EPYC Zen 5, one thread, 512 x 512): 1.1x at one row,
   1.7x at four, 1.8x at eight.
   At many rows it is a register-tiled GEMM (6 rows x 4 vectors of sums, the panel in L2 across row groups), so the
   experts take it at every step size.
   Results equal a GEMM's to float rounding: each output sums its K products in order, one lane each. */
#include "cpu_kernels.h"

#define PF_AHEAD 4096 /* bytes of the panel (the next one's first where it ends) prefetched ahead of the row groups'
                         reads: without, 15-20% slower at 64-256 tokens a step; 2-8 KiB within noise of each other */

/* y[r, j] (j < NV VW) (+)= sum_k x[r, k] wp[k pw + j] for r < RB, k < kn: one panel of NV vectors by RB rows
   (x's rows ldx apart), added to y where ``add``. */
#define PAN(RB, NV)                                                                                                 \
    static void pan_##RB##_##NV(const float *x, int64_t ldx, int64_t kn, const float *wp, float *y, int64_t ldy,   \
                                int add) {                                                                          \
        vec acc[RB][NV];                                                                                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                                        \
            _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) acc[r][j] = add ? load(y + r * ldy + j * VW) : (vec){0}; \
        for (int64_t k = 0; k < kn; k++) {                                                                          \
            const float *wk = wp + k * (NV * VW);                                                                   \
            _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) /* a line each, PF_AHEAD bytes on */                \
                __builtin_prefetch(wk + PF_AHEAD / 4 + j * VW, 0, 3);                                               \
            vec w[NV];                                                                                              \
            _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) w[j] = load(wk + j * VW);                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                                                  \
                const vec b = splat(x[r * ldx + k]);                                                                \
                _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) acc[r][j] += w[j] * b;                         \
            }                                                                                                       \
        }                                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                                        \
            _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++) memcpy(y + r * ldy + j * VW, &acc[r][j], sizeof(vec)); \
    }
typedef void (*pan_fn)(const float *, int64_t, int64_t, const float *, float *, int64_t, int);
#ifdef __AVX512F__ /* 32 vector registers: up to 6 rows x 4 vectors of sums */
#define PAN_ROWS(NV) PAN(1, NV) PAN(2, NV) PAN(4, NV) PAN(6, NV)
#define PAN_FNS(NV) {pan_1_##NV, pan_2_##NV, pan_4_##NV, pan_6_##NV}
static const int64_t GROUP[4] = {1, 2, 4, 6};
#else /* 16 registers of half a vec each: one or two rows */
#define PAN_ROWS(NV) PAN(1, NV) PAN(2, NV)
#define PAN_FNS(NV) {pan_1_##NV, pan_2_##NV, pan_2_##NV, pan_2_##NV}
static const int64_t GROUP[4] = {1, 2, 2, 2};
#endif
PAN_ROWS(1)
PAN_ROWS(2)
PAN_ROWS(3)
PAN_ROWS(4)
static const pan_fn PANS[4][4] = {PAN_FNS(1), PAN_FNS(2), PAN_FNS(3), PAN_FNS(4)}; /* [NV - 1][row group] */

/* One row by PS whole panels at once (PS streams, as gemv reads four weight rows): a single stream of one panel
   after another left the row's memory reads short of gemv's on cold experts. */
#define PS 4
static void pan_1_streams(const float *x, int64_t K, const float *wp, float *y) {
    vec acc[PS][4];
    _Pragma("GCC unroll 4") for (int s = 0; s < PS; s++)
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) acc[s][j] = (vec){0};
    for (int64_t k = 0; k < K; k++) {
        const vec b = splat(x[k]);
        _Pragma("GCC unroll 4") for (int s = 0; s < PS; s++) {
            const float *wk = wp + s * PANEL * K + k * PANEL;
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) acc[s][j] += load(wk + j * VW) * b;
        }
    }
    _Pragma("GCC unroll 4") for (int s = 0; s < PS; s++)
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) memcpy(y + s * PANEL + j * VW, &acc[s][j], sizeof(vec));
}

/* Rows beyond one group run over a panel in steps of KSTEP k's, every group over one step before the next, so the
   step's part of the panel (KSTEP pw floats, 32 KB) is read from memory once and from L1 after. */
#define KSTEP 128

void panel_gemv(const float *x, int64_t rows, int64_t K, const float *wp, int64_t N, float *y, int64_t ldy) {
    const int64_t ks = rows <= GROUP[3] ? K : KSTEP;
    int64_t n0 = 0;
    if (rows == 1)
        for (; n0 + PS * PANEL <= N; n0 += PS * PANEL) pan_1_streams(x, K, wp + n0 * K, y + n0);
    for (; n0 < N; n0 += PANEL) {
        const int64_t pw = N - n0 < PANEL ? N - n0 : PANEL;
        const pan_fn *fn = PANS[pw / VW - 1];
        for (int64_t k0 = 0; k0 < K; k0 += ks) {
            const int64_t kn = K - k0 < ks ? K - k0 : ks;
            const float *w = wp + n0 * K + k0 * pw;
            for (int64_t r = 0, g = 3; r < rows; r += GROUP[g]) { /* the widest row groups first */
                while (r + GROUP[g] > rows) g--;
                fn[g](x + r * K + k0, K, kn, w, y + r * ldy + n0, ldy, k0 > 0);
            }
        }
    }
}
